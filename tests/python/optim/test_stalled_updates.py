"""The device-side count of stalled updates (NOTE [stalled updates] in
csrc/common/lean_state.h): elements of float16/bfloat16 params kept without a
master whose stored value did not change although the step computed another
one, counted exactly, on the device, eager or compiled."""

import pytest
import torch
from torch import nn

from fusetrain.optim import SGD, AdamW, Lamb

from _test_helpers import DEVICES


def _exact_params(device, dtype, n=5003):
    # Values with few mantissa bits and steps of a power of two: every update
    # p - lr * g is exact in float32, so which ones round back is known.
    torch.manual_seed(0)
    base = (torch.randint(-64, 64, (n,), device=device).float() / 16).to(dtype)
    return nn.Parameter(base.clone())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_nearest_stalls_are_counted_exactly(device, dtype):
    p = _exact_params(device, dtype)
    opt = SGD([p], lr=2.0 ** -12)
    counter = opt.track_stalled_updates()
    assert counter is opt.stalled_updates and counter.dtype == torch.int64 and counter.device == p.device
    total = 0
    for step in range(3):
        g = torch.randint(-2, 3, p.shape, device=device).float()  # 0, +-1, +-2: some updates are zero
        g[:7] = 4096.0  # an update of 1: it moves the value
        before = p.detach().clone()
        p.grad = g.to(dtype)
        new = before.float() - 2.0 ** -12 * g
        opt.step()
        assert torch.equal(p.detach(), new.to(dtype))
        total += int(((new.to(dtype) == before) & (new != before.float())).sum())
    assert int(counter) == total > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "int8"])
def test_stochastic_rounding_stalls_are_the_unchanged_elements(device, state_dtype):
    # SGD's first momentum step moves by lr * g exactly (the buffer starts as
    # the gradient), so an update is zero exactly where g is; the 5003-element
    # param takes int8 momentum (the 8-bit kernel).
    p = _exact_params(device, torch.bfloat16)
    opt = SGD([p], lr=2.0 ** -12, momentum=0.9, master_weights="stochastic", state_dtype=state_dtype)
    counter = opt.track_stalled_updates()
    g = torch.randint(-2, 3, p.shape, device=device).float()
    before = p.detach().clone()
    p.grad = g.bfloat16()
    opt.step()
    expected = int(((p.detach() == before) & (g != 0)).sum())
    assert int(counter) == expected > 0 and int((p.detach() != before).sum()) > 0


def test_params_with_masters_and_float32_are_not_counted():
    torch.manual_seed(2)
    p16 = nn.Parameter(torch.randn(300).bfloat16())
    p32 = nn.Parameter(torch.randn(300))
    opt = AdamW([{"params": [p16], "master_weights": "remainder"}, {"params": [p32]}], lr=1e-6)
    counter = opt.track_stalled_updates()
    for _ in range(2):
        p16.grad, p32.grad = torch.randn_like(p16), torch.randn_like(p32)
        opt.step()
    assert int(counter) == 0


def test_counting_can_stop_and_compiles():
    p = _exact_params("cpu", torch.bfloat16, 600)
    opt = SGD([p], lr=2.0 ** -12)
    counter = opt.track_stalled_updates()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step():
        opt.step()

    p.grad = torch.ones_like(p)
    step()
    assert int(counter) > 0
    counter.zero_()
    step()
    first = int(counter)
    assert first > 0
    assert opt.track_stalled_updates(False) is None and opt.stalled_updates is None
    opt.step()
    assert int(counter) == first


def test_track_stalled_updates_errors():
    p = nn.Parameter(torch.randn(10).bfloat16())
    with pytest.raises(ValueError, match="element-wise optimizers count stalled updates"):
        Lamb([p], lr=1e-3).track_stalled_updates()
    with pytest.raises(ValueError, match="stalled_out must be an int64 tensor"):
        p.grad = torch.ones_like(p)
        opt = SGD([p], lr=1e-3)
        opt._results["stalled"] = torch.zeros(())
        opt.step()
