"""fusetrain::update_scale_ against torch._amp_update_scale_.

Both update a float32 scale and an int32 growth tracker in place from a
float32 non-finite flag: back off and reset the tracker on a non-finite step,
otherwise count the clean step and multiply the scale by ``growth_factor``
every ``growth_interval`` clean steps, unless the grown scale would be
inf. With the usual power-of-two factors every product is exact, so the two
trajectories must be bit-identical, with one difference by design: a backoff
stops at the floor 2**-126 (the smallest normal float32; NOTE [scale floor])
where torch's scale goes on to subnormals and 0.
"""

import random

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain._ops import update_scale_

from _test_helpers import CUDA, DEVICES

F32_MAX = torch.finfo(torch.float32).max
FLOOR = 2.0**-126


def state(scale, tracker, device):
    return (torch.tensor(scale, dtype=torch.float32, device=device),
            torch.tensor(tracker, dtype=torch.int32, device=device))


def run_both(scale, tracker, flags, growth_factor, backoff_factor, growth_interval, device):
    """Step both implementations through ``flags``; yield (ours, torch's) after each step."""
    ours = state(scale, tracker, device)
    ref = state(scale, tracker, device)
    for flag in flags:
        found_inf = torch.tensor(flag, dtype=torch.float32, device=device)
        update_scale_(ours[0], ours[1], found_inf, growth_factor, backoff_factor, growth_interval)
        torch._amp_update_scale_(ref[0], ref[1], found_inf, growth_factor, backoff_factor, growth_interval)
        if flag != 0 and not ref[0].item() > FLOOR:  # NaN included
            ref[0].fill_(FLOOR)
        yield ours, ref


def assert_same(ours, ref, what=""):
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int32
    assert torch.equal(ours[0], ref[0]) or (ours[0].isnan().item() and ref[0].isnan().item()), \
        f"{what}: scale {ours[0].item()!r} vs torch {ref[0].item()!r}"
    assert torch.equal(ours[1], ref[1]), f"{what}: growth tracker {ours[1].item()} vs torch {ref[1].item()}"


# ---- values --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("growth_interval", [1, 2, 3, 7, 2000])
@pytest.mark.parametrize("p_inf", [0.0, 0.1, 0.4, 1.0])
def test_random_sequences_match_torch(device, growth_interval, p_inf):
    rng = random.Random(growth_interval * 1000 + int(p_inf * 10))
    flags = [1.0 if rng.random() < p_inf else 0.0 for _ in range(300)]
    grew = backed_off = 0
    prev = 2.0**16
    for i, (ours, ref) in enumerate(run_both(2.0**16, 0, flags, 2.0, 0.5, growth_interval, device)):
        assert_same(ours, ref, f"step {i}")
        cur = ours[0].item()
        grew += cur > prev
        backed_off += cur < prev
        prev = cur
    # The sequences exercise what they claim to: all clean steps grow the scale
    # until 2**127 (111 doublings of 2**16; the next one would be inf), all
    # non-finite ones halve it down to the floor 2**-126, where it stays.
    if p_inf == 1.0:
        assert grew == 0 and backed_off == 16 + 126 and ours[0].item() == FLOOR
    if p_inf == 0.0:
        assert backed_off == 0 and grew == min(300 // growth_interval, 127 - 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("growth_factor,backoff_factor", [(2.0, 0.5), (4.0, 0.25), (2.0, 0.125), (8.0, 0.5)])
def test_power_of_two_factors_match_torch(device, growth_factor, backoff_factor):
    rng = random.Random(7)
    flags = [1.0 if rng.random() < 0.3 else 0.0 for _ in range(200)]
    for i, (ours, ref) in enumerate(run_both(1024.0, 0, flags, growth_factor, backoff_factor, 3, device)):
        assert_same(ours, ref, f"step {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_other_factors_match_torch_bit_exactly(device):
    # Factors that are not powers of two: torch multiplies in double and rounds
    # once, as update_scale_ does, so the trajectories are bit-identical.
    rng = random.Random(11)
    flags = [1.0 if rng.random() < 0.3 else 0.0 for _ in range(60)]
    ours, ref = state(1000.0, 0, device), state(1000.0, 0, device)
    for i, flag in enumerate(flags):
        found_inf = torch.tensor(flag, device=device)
        update_scale_(ours[0], ours[1], found_inf, 1.7, 0.3, 2)
        torch._amp_update_scale_(ref[0], ref[1], found_inf, 1.7, 0.3, 2)
        assert torch.equal(ours[1], ref[1]), f"step {i}"
        assert torch.equal(ours[0], ref[0]), f"step {i}"


def test_non_power_of_two_factors_bit_identical_to_torch():
    ours, ref = state(255069.765625, 0, "cpu"), state(255069.765625, 0, "cpu")
    found_inf = torch.zeros(())
    update_scale_(ours[0], ours[1], found_inf, 1.7, 0.5, 1)
    torch._amp_update_scale_(ref[0], ref[1], found_inf, 1.7, 0.5, 1)
    assert_same(ours, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [F32_MAX, 2.0**127, 1.5 * 2.0**127, F32_MAX / 2.0 * 1.0000001])
def test_growth_never_reaches_inf(device, scale):
    # A grown scale that would be inf is not taken; the tracker still resets.
    ours, ref = state(scale, 2, device), state(scale, 2, device)
    found_inf = torch.zeros((), device=device)
    update_scale_(ours[0], ours[1], found_inf, 2.0, 0.5, 3)
    torch._amp_update_scale_(ref[0], ref[1], found_inf, 2.0, 0.5, 3)
    assert_same(ours, ref)
    assert ours[0].item() == torch.tensor(scale).item(), "the scale must not change"
    assert ours[1].item() == 0
    # A long run of clean steps keeps it finite.
    for i, (o, r) in enumerate(run_both(scale, 0, [0.0] * 20, 2.0, 0.5, 1, device)):
        assert_same(o, r, f"step {i}")
        assert torch.isfinite(o[0]).item()


@pytest.mark.parametrize("device", DEVICES)
def test_growth_just_below_max_is_taken(device):
    # 2**126 * 2 = 2**127 is finite: it must grow.
    ours = state(2.0**126, 0, device)
    update_scale_(ours[0], ours[1], torch.zeros((), device=device), 2.0, 0.5, 1)
    assert ours[0].item() == 2.0**127


@pytest.mark.parametrize("device", DEVICES)
def test_backoff_stops_at_the_floor(device):
    # torch's scale reaches 0 after 150 halvings of 1.0 and the next finite
    # step unscales by 1/0; this one stops at the smallest normal float32 and
    # grows again from there.
    flags = [1.0] * 160 + [0.0] * 3
    for i, (ours, ref) in enumerate(run_both(1.0, 0, flags, 2.0, 0.5, 3, device)):
        assert_same(ours, ref, f"step {i}")
        if i == 159:
            assert ours[0].item() == FLOOR
    assert ours[0].item() == 2 * FLOOR
    odd = state(3 * FLOOR, 0, device)  # a backoff that would land between floor and 0
    update_scale_(odd[0], odd[1], torch.ones((), device=device), 2.0, 0.25, 3)
    assert odd[0].item() == FLOOR


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [1.0, -1.0, 2.0, 1e-30, float("inf"), float("nan")])
def test_any_nonzero_flag_backs_off(device, flag):
    ours, ref = state(512.0, 5, device), state(512.0, 5, device)
    found_inf = torch.tensor(flag, device=device)
    update_scale_(ours[0], ours[1], found_inf, 2.0, 0.5, 10)
    torch._amp_update_scale_(ref[0], ref[1], found_inf, 2.0, 0.5, 10)
    assert_same(ours, ref)
    assert ours[0].item() == 256.0 and ours[1].item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale,tracker", [(float("inf"), 0), (float("nan"), 0), (3.0, 9), (5.0, -4), (0.0, 1)])
def test_unusual_states_match_torch(device, scale, tracker):
    # A tracker already past the interval, a negative tracker, inf/NaN/zero scales.
    flags = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    for i, (ours, ref) in enumerate(run_both(scale, tracker, flags, 2.0, 0.5, 2, device)):
        assert_same(ours, ref, f"step {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_and_inputs_untouched(device):
    scale, tracker = state(8.0, 0, device)
    found_inf = torch.zeros((), device=device)
    ptrs = (scale.data_ptr(), tracker.data_ptr())
    update_scale_(scale, tracker, found_inf, 2.0, 0.5, 1)
    assert (scale.data_ptr(), tracker.data_ptr()) == ptrs
    assert scale.item() == 16.0 and tracker.item() == 0
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_one_element_shapes(device):
    # One-element tensors of shape (1,) are accepted, as by torch.
    scale = torch.full((1,), 4.0, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    update_scale_(scale, tracker, torch.ones(1, device=device), 2.0, 0.5, 2)
    assert scale.tolist() == [2.0] and tracker.tolist() == [0]


# ---- errors --------------------------------------------------------------------------


def _args(**over):
    a = dict(scale=torch.tensor(2.0), growth_tracker=torch.tensor(0, dtype=torch.int32), found_inf=torch.tensor(0.0),
             growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    a.update(over)
    return a


def _call(a):
    update_scale_(a["scale"], a["growth_tracker"], a["found_inf"], a["growth_factor"], a["backoff_factor"],
                  a["growth_interval"])


@pytest.mark.parametrize("over,msg", [
    (dict(scale=torch.tensor(2.0, dtype=torch.float64)), "scale must be a float32 tensor with one element"),
    (dict(scale=torch.tensor(2.0, dtype=torch.float16)), "scale must be a float32 tensor with one element"),
    (dict(scale=torch.ones(2)), "scale must be a float32 tensor with one element"),
    (dict(growth_tracker=torch.tensor(0)), "growth_tracker must be an int32 tensor with one element"),
    (dict(growth_tracker=torch.tensor(0.0)), "growth_tracker must be an int32 tensor with one element"),
    (dict(growth_tracker=torch.zeros(3, dtype=torch.int32)), "growth_tracker must be an int32 tensor"),
    (dict(found_inf=torch.tensor(0, dtype=torch.int32)), "found_inf must be a float32 tensor with one element"),
    (dict(found_inf=torch.zeros(2)), "found_inf must be a float32 tensor with one element"),
    (dict(growth_factor=1.0), "growth_factor must be a finite number > 1"),
    (dict(growth_factor=0.5), "growth_factor must be a finite number > 1"),
    (dict(growth_factor=float("inf")), "growth_factor must be a finite number > 1, got inf"),
    (dict(growth_factor=float("nan")), "growth_factor must be a finite number > 1, got nan"),
    (dict(backoff_factor=float("nan")), r"backoff_factor must be in \(0, 1\), got nan"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=-0.5), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be > 0"),
    (dict(growth_interval=-3), "growth_interval must be > 0"),
])
def test_rejects_bad_arguments(over, msg):
    a = _args(**over)
    before = (a["scale"].clone(), a["growth_tracker"].clone())
    # A bad tensor is a RuntimeError, a bad number a ValueError.
    with pytest.raises((RuntimeError, ValueError), match=msg):
        _call(a)
    assert torch.equal(a["scale"], before[0]) and torch.equal(a["growth_tracker"], before[1])


@CUDA
@pytest.mark.parametrize("moved", ["growth_tracker", "found_inf"])
def test_rejects_mixed_devices(moved):
    a = _args(scale=torch.tensor(2.0, device="cuda"), growth_tracker=torch.tensor(0, dtype=torch.int32, device="cuda"),
              found_inf=torch.tensor(0.0, device="cuda"))
    a[moved] = a[moved].cpu()
    with pytest.raises(RuntimeError, match="must be on one device"):
        _call(a)


# ---- registration --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    op = torch.ops.fusetrain.update_scale_
    for flag, tracker in [(0.0, 0), (0.0, 1), (1.0, 1)]:
        scale, gt = state(1024.0, tracker, device)
        torch.library.opcheck(op, (scale, gt, torch.tensor(flag, device=device), 2.0, 0.5, 2), {})
