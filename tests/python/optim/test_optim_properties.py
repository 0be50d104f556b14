"""Property-based tests (NOTE [hypothesis profiles] in conftest.py) of every optimizer class of the optimizer
table, the composite ones (Lamb, AdamP, Muon) included: a few steps on generated params (counts, sizes at the
block edges, views, dtypes) with hyper-parameters at their edges against the class's reference (the optimizer
case table of _optim_helpers.py) run on float64 copies; a non-finite gradient under clipping skips the step
with nothing written; lean (bfloat16) and 8-bit state skip as exactly and stay near the float32 state."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _lean_helpers import LEAN, LEAN_IDS
from _optim_helpers import OPTIMS, reference
from _property_helpers import (EDGE_SIZES, assert_close64, assert_unchanged, examples, inject, make_tensor,
                               snapshot)
from _test_helpers import DEVICES

#: The composite classes compare at their own tests' tolerance: their per-tensor norms and Newton-Schulz
#: iterations (Muon) are float32 (bfloat16 in torch's Muon) whatever the reference's dtype.
SCALE = {"Lamb": 20.0, "AdamP": 20.0, "Muon": 2000.0}


def _shapes(draw, name):
    count = draw(st.integers(1, 6))
    if name == "Muon":  # matrices (torch.optim.Muon takes nothing else)
        return [draw(st.sampled_from([(3, 5), (8, 8), (1, 17), (16, 4)])) for _ in range(count)]
    return [(draw(st.sampled_from(EDGE_SIZES[1:20])),) if draw(st.booleans()) else
            draw(st.sampled_from([(2, 3), (4, 1, 3, 2), (1, 129)])) for _ in range(count)]


def _grads(shapes, device, gen):
    return [torch.randn(s, generator=gen, dtype=torch.float64).float().to(device) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMS))
@examples(0.5)
@given(data=st.data())
def test_every_optimizer_follows_its_reference_in_float64(device, name, data):
    draw = data.draw
    row = OPTIMS[name]
    hp = dict(row.hp, **draw(st.sampled_from(row.configs or ({},))))
    hp["lr"] = draw(st.sampled_from([0.0, row.lr, row.lr * 4]))
    if "weight_decay" in hp or name in ("Lamb", "AdamP", "Muon", "Lion"):
        hp["weight_decay"] = draw(st.sampled_from([0.0, hp.get("weight_decay", 0.0), 1.0]))
    clip = draw(st.sampled_from([None, 1e-6, 0.5]))
    shapes = _shapes(draw, name)
    layout = draw(st.sampled_from(["contiguous", "offset", "channels_last"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = [torch.randn(s, generator=gen, dtype=torch.float64).float() for s in shapes]
    params = [torch.nn.Parameter(make_tensor(b.to(device), layout)) for b in base]
    ref = [torch.nn.Parameter(b.double()) for b in base]
    # timm's Lamb clips in its step (max_grad_norm); the others' references after clip_grad_norm_.
    hp.pop("max_grad_norm", None)
    opt = row.ours(params, **hp, max_grad_norm=clip)
    ropt = reference(name, ref, **(dict(hp, max_grad_norm=clip) if name == "Lamb" else hp))
    bad_step = draw(st.sampled_from([None, 1, 2])) if clip is not None else None
    for k in range(3):
        grads = _grads(shapes, device, gen)
        if k == bad_step and inject(draw, grads, p=1.0):
            for p, g in zip(params, grads):
                p.grad = g
            before = snapshot(params, [v for p in params for v in opt.state[p].values() if torch.is_tensor(v)])
            opt.step()
            assert opt.last_found_inf.item() == 1.0
            assert_unchanged(before, params, [v for p in params for v in opt.state[p].values() if torch.is_tensor(v)])
            continue
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g, g.to("cpu", torch.float64)
        if clip is not None and name != "Lamb":
            torch.nn.utils.clip_grad_norm_(ref, clip)
        opt.step()
        ropt.step()
    for i, (p, r) in enumerate(zip(params, ref)):
        assert_close64(p, r.detach().view(p.shape), f"{name} param {i}", scale=SCALE.get(name, 10.0),
                       floor=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,kw", LEAN, ids=LEAN_IDS)
@examples(0.5)
@given(state_dtype=st.sampled_from(["bfloat16", "int8"]), block=st.sampled_from([64, 128, 256]),
       n=st.sampled_from([1, 63, 64, 65, 127, 129, 255, 256, 257, 511, 513]), master=st.booleans(), data=st.data())
def test_lean_state_skips_exactly_and_stays_near_float32_state(device, cls, kw, state_dtype, block, n, master,
                                                                 data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    base = [torch.randn(n, generator=gen), torch.randn(3, n, generator=gen)]
    dtype = torch.bfloat16 if master else torch.float32
    lean = [torch.nn.Parameter(b.to(device, dtype)) for b in base]
    full = [torch.nn.Parameter(b.to(device, dtype)) for b in base]
    extra = dict(master_weights=True) if master else {}
    opt = cls(lean, **kw, state_dtype=state_dtype, state_block_size=block, max_grad_norm=10.0, **extra)
    ref = cls(full, **kw, max_grad_norm=10.0, **extra)
    bad = data.draw(st.sampled_from([None, 1, 2]))
    for k in range(3):
        grads = [torch.randn(b.shape, generator=gen).to(device, dtype) for b in base]
        if k == bad:
            inject(data.draw, grads, p=1.0)
            for p, g in zip(lean, grads):
                p.grad = g
            state = [v for p in lean for v in opt.state[p].values() if torch.is_tensor(v)]
            before = snapshot(lean, state)
            opt.step()
            assert opt.last_found_inf.item() == 1.0
            assert_unchanged(before, lean, state)
            continue
        for p, q, g in zip(lean, full, grads):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
    lr = kw["lr"]
    for p, q in zip(lean, full):
        assert torch.isfinite(p).all()
        # Each of the (at most 3) updates moves a param by about lr (times the gradient for SGD and Adadelta's
        # lr 1); lean state changes an update by a fraction of it.
        worst = (p.detach().float() - q.detach().float()).abs().max().item()
        assert worst <= 3 * lr * (0.5 if state_dtype == "int8" else 0.1) * 4 + 2 * torch.finfo(dtype).eps * 4, worst
