"""Lean optimizer state (NOTE [lean state] in csrc/common/lean_state.h): remainder and stochastic master
weights, bfloat16 moments. The stochastic roundings are checked bit for bit against the counter-based
stream recomputed here, and statistically for bias."""

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import fusetrain.optim as fo
from fusetrain import TrainStep
from fusetrain.optim._state_layout import _join_remainder, _split_remainder
from _lean_helpers import LEAN, LEAN_IDS, M32, grads as _grads, rounding_bits as _rounding_bits, run as _run
from _lean_helpers import state_draw as _state_draw
from _test_helpers import CUDA, DEVICES, kind_record

SHAPES = [(1,), (7,), (13, 17), (1031,), (3, 5, 7), (70001,)]


def _stochastic_bf16(x32, step, tensor, stream, shift=0):
    """The kernels' stochastic rounding of float32 ``x32`` to bfloat16 with the bits of ``stream`` shifted
    right by ``shift``."""
    flat = x32.detach().cpu().float().reshape(-1)
    b = flat.view(torch.int32).to(torch.int64) & M32
    b = (b + ((_rounding_bits(step, tensor, stream, flat.numel()) >> shift) & 0xFFFF)) >> 16
    b = torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16)
    return b.view(torch.bfloat16).reshape(x32.shape)


def _params(device, dtype=torch.bfloat16, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]


# ---- remainder: the exact float32 master in 2 bytes ----------------------------------------------
def test_split_and_join_are_inverse_and_round_to_nearest():
    x = torch.cat([torch.randn(100000) * 10 ** torch.randint(-30, 30, (100000,)).float(),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45, float("inf"), -float("inf")])])
    hi, rem = _split_remainder(x)
    assert torch.equal(_join_remainder(hi, rem).view(torch.int32), x.view(torch.int32))
    ties = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(hi[~ties], x[~ties].to(torch.bfloat16))  # round to nearest away from ties


@pytest.mark.parametrize("device", DEVICES)
def test_a_remainder_step_splits_every_value_as_the_split_does(device):
    """A step that leaves the value as it is (lr 0, zero grads) joins and splits every element, in whole
    vectors and in tails: ties, infinities, the largest finites, subnormals and NaN (a quiet NaN with
    remainder 0) come back as the split gives them."""
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([0.0, -0.0, 3.4028235e38, -3.4028235e38, float("inf"), -float("inf"), 1e-45, -1e-40,
                            float("nan"), 1.0 + 2.0 ** -8, -(1.0 + 3 * 2.0 ** -8)])  # the last two are ties
    values = []
    for n in (1031, 8, 5):
        x = torch.randn(n, generator=g) * 10 ** torch.randint(-30, 30, (n,), generator=g).float()
        x[torch.randint(0, n, (min(n, len(special)),), generator=g)] = special[:min(n, len(special))]
        values.append(x)
    params = [nn.Parameter(torch.zeros(len(x), dtype=torch.bfloat16, device=device)) for x in values]
    opt = fo.SGD(params, lr=0.0, master_weights="remainder")
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, x in zip(params, values):
        hi, rem = _split_remainder(x)
        with torch.no_grad():
            p.copy_(hi)
        opt.state[p]["master_remainder"].copy_(rem)
    opt.step()
    for p, x in zip(params, values):
        hi, rem = _split_remainder(x)
        got_rem = opt.state[p]["master_remainder"].cpu()
        nan = x.isnan()
        assert torch.equal(p.detach().cpu()[~nan].view(torch.int16), hi[~nan].view(torch.int16))
        assert torch.equal(got_rem[~nan], rem[~nan])
        assert p.detach().cpu()[nan].isnan().all() and (got_rem[nan] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,kw", LEAN, ids=LEAN_IDS)
def test_remainder_is_the_float32_master_bit_for_bit(device, cls, kw):
    full = _params(device)
    lean = _params(device)
    a = _run(cls, kw, full, 6, master_weights=True, max_grad_norm=5.0)
    b = _run(cls, kw, lean, 6, master_weights="remainder", max_grad_norm=5.0)
    for p, q in zip(full, lean):
        master = a.state[p]["master_param"]
        rem = b.state[q]["master_remainder"]
        assert rem.dtype == torch.int16 and "master_param" not in b.state[q]
        assert torch.equal(_join_remainder(q.detach(), rem).view(torch.int32), master.view(torch.int32))
        ties = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(q[~ties], p[~ties])  # the params differ in exact ties only
        for name, v in a.state[p].items():
            if name not in ("master_param", "step"):
                assert torch.equal(v, b.state[q][name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_remainder_follows_a_write_to_the_param_and_survives_a_resume(device):
    params = _params(device, shapes=[(257,), (5, 9)])
    opt = _run(fo.AdamW, dict(lr=1e-2), params, 3, master_weights="remainder")
    with torch.no_grad():
        params[0].fill_(0.5)  # written outside the optimizer: the param is the value
    saved = copy.deepcopy(opt.state_dict())
    snap = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(params, 50)):
        p.grad = g
    opt.step()
    assert opt.state[params[0]]["master_remainder"].abs().sum() > 0  # the step wrote a new remainder
    # A remainder is zeroed when its param is written alone; the step then starts from exactly 0.5.
    ref = [nn.Parameter(t.clone()) for t in snap]
    ref_opt = fo.AdamW(ref, lr=1e-2, master_weights="remainder")
    ref_opt.load_state_dict(saved)
    ref_opt.state[ref[0]]["master_remainder"].zero_()
    for p, g in zip(ref, _grads(ref, 50)):
        p.grad = g
    ref_opt.step()
    assert torch.equal(ref[0], params[0])
    # Loaded together (a resume), param and remainder are kept as they were saved.
    assert torch.equal(ref[1], params[1])
    assert torch.equal(ref_opt.state[ref[1]]["master_remainder"], opt.state[params[1]]["master_remainder"])


@pytest.mark.parametrize("device", DEVICES)
def test_state_dicts_convert_between_float32_masters_and_remainders(device):
    base = _params(device)
    full = [nn.Parameter(p.detach().clone()) for p in base]
    a = _run(fo.AdamW, dict(lr=1e-2), full, 3, master_weights=True)
    lean = [nn.Parameter(p.detach().clone()) for p in full]
    b = fo.AdamW(lean, lr=1e-2, master_weights="remainder", state_dtype=torch.bfloat16)
    b.load_state_dict(a.state_dict())  # a float32 state into a lean optimizer
    assert b.param_groups[0]["master_weights"] == "remainder" and b.param_groups[0]["state_dtype"] == "bfloat16"
    b2 = fo.AdamW([nn.Parameter(p.detach().clone()) for p in full], lr=1e-2, master_weights=True)
    for opt, ps in ((a, full), (b, lean)):
        for p, g in zip(ps, _grads(ps, 9)):
            p.grad = g
        opt.step()
    for p, q in zip(full, lean):
        assert b.state[q]["exp_avg"].dtype == torch.bfloat16
        assert "master_param" not in b.state[q]
        # The master carried over exactly: one more step differs from the float32 run only by the moments'
        # bfloat16 rounding.
        torch.testing.assert_close(_join_remainder(q.detach(), b.state[q]["master_remainder"]),
                                   a.state[p]["master_param"], rtol=0, atol=2e-4)
    # And back: a lean state into a float32 optimizer joins the remainders into masters. Its group sets
    # master_weights, which it keeps; the state dtype comes from the state dict unless set after loading.
    b2.load_state_dict(b.state_dict())
    assert b2.param_groups[0]["master_weights"] is True and b2.param_groups[0]["state_dtype"] == "bfloat16"
    b2.param_groups[0]["state_dtype"] = "float32"
    ps2 = b2.param_groups[0]["params"]
    for q, p2 in zip(lean, ps2):
        with torch.no_grad():
            p2.copy_(q)
        p2.grad = torch.zeros_like(p2)
    b2.param_groups[0]["lr"] = 0.0
    b2.param_groups[0]["weight_decay"] = 0.0
    b2.step()
    for q, p2 in zip(lean, ps2):
        assert b2.state[p2]["exp_avg"].dtype == torch.float32 and "master_remainder" not in b2.state[p2]
        joined = _join_remainder(q.detach(), b.state[q]["master_remainder"])
        ties = (joined.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(b2.state[p2]["master_param"][~ties], joined[~ties])


# ---- stochastic rounding -------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,kw", LEAN, ids=LEAN_IDS)
def test_stochastic_params_and_bf16_state_are_the_stream_s_rounding(device, cls, kw):
    """One step from the same state: float32 params/state give the values before rounding; the lean run
    stores exactly their stochastic rounding with the stream of (step, tensor, slot, element)."""
    lean = _params(device)
    wide = [nn.Parameter(p.detach().float()) for p in lean]
    a = _run(cls, kw, wide, 1, seed=4)
    b = _run(cls, kw, lean, 1, seed=4, master_weights="stochastic", state_dtype=torch.bfloat16)
    for t, (p, q) in enumerate(zip(wide, lean)):
        assert torch.equal(q.detach().cpu(), _stochastic_bf16(p, 1, t, 0)), t
        names = [n for n, v in a.state[p].items() if n != "step" and v.dim() > 0]
        assert names
        for name in names:
            slot = list(a._state_names(a.param_groups[0])).index(name)
            got = b.state[q][name]
            assert got.dtype == torch.bfloat16
            assert torch.equal(got.cpu(), _stochastic_bf16(a.state[p][name], 1, t, *_state_draw(slot))), (t, name)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_is_unbiased(device):
    # p = 1.5 (bf16 ulp 2^-7 there) moves down by 0.3 ulp per step: round to nearest never moves it.
    n = 1 << 18
    ulp = 2.0 ** -7
    for master in (False, "stochastic"):
        p = nn.Parameter(torch.full((n,), 1.5, dtype=torch.bfloat16, device=device))
        opt = fo.SGD([p], lr=1.0, master_weights=master)
        p.grad = torch.full_like(p, 0.3 * ulp)
        frac = p.grad[0].item() / ulp  # the bfloat16 gradient, about 0.3 ulp
        opt.step()
        down = (p.float() < 1.5).float().mean().item()
        mean = p.double().mean().item()
        if master is False:
            assert down == 0.0
        else:
            sd = ulp * (frac * (1 - frac) / n) ** 0.5
            assert abs(mean - (1.5 - frac * ulp)) < 5 * sd, mean
            assert abs(down - frac) < 5 * (frac * (1 - frac) / n) ** 0.5
    # Over many steps the expectation follows the float64 trajectory while round to nearest stalls.
    p = nn.Parameter(torch.full((n,), 1.5, dtype=torch.bfloat16, device=device))
    opt = fo.SGD([p], lr=1.0, master_weights="stochastic")
    for _ in range(50):
        p.grad = torch.full_like(p, 0.1 * ulp)
        opt.step()
    expected = 1.5 - 50 * p.grad[0].item()
    assert abs(p.double().mean().item() - expected) < 0.04 * ulp


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_runs_are_reproducible_and_resume_exactly(device):
    def run(resume_at=None):
        params = _params(device, shapes=[(301,), (4, 33)])
        opt = fo.AdamW(params, lr=1e-2, master_weights="stochastic", state_dtype="bfloat16")
        for k in range(6):
            if k == resume_at:
                saved = copy.deepcopy(opt.state_dict())
                params = [nn.Parameter(p.detach().clone()) for p in params]
                opt = fo.AdamW(params, lr=1e-2, master_weights="stochastic", state_dtype="bfloat16")
                opt.load_state_dict(saved)
            for p, g in zip(params, _grads(params, 20 + k)):
                p.grad = g
            opt.step()
        return params, opt

    a, oa = run()
    b, ob = run(resume_at=3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(oa.state[p]["exp_avg_sq"], ob.state[q]["exp_avg_sq"])
    # Different tensors (and elements) draw different bits: two equal params with equal gradients part.
    p1, p2 = (nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16, device=device)) for _ in range(2))
    opt = fo.SGD([p1, p2], lr=1.0, master_weights="stochastic")
    p1.grad = torch.full_like(p1, 0.5 * 2 ** -7)
    p2.grad = p1.grad.clone()
    opt.step()
    assert 0.4 < (p1 != p2).float().mean().item() < 0.6


def test_bf16_moments_keep_decaying():
    """exp_avg_sq * 0.999 rounds back to itself in bfloat16 with round to nearest; stochastic rounding
    keeps the decay in expectation."""
    n = 1 << 16
    p = nn.Parameter(torch.zeros(n))
    opt = fo.Adam([p], lr=0.0, betas=(0.9, 0.999), state_dtype=torch.bfloat16)
    p.grad = torch.ones(n)
    opt.step()
    for _ in range(200):
        p.grad = torch.zeros(n)
        opt.step()
    expected = 1e-3 * 0.999 ** 200
    assert abs(opt.state[p]["exp_avg_sq"].double().mean().item() / expected - 1) < 0.01


# ---- the rest of the step still holds --------------------------------------------------------------
def test_lean_state_bytes_per_param():
    params = _params("cpu", shapes=[(1000,), (24, 50)])
    n = sum(p.numel() for p in params)
    for lean, expected in (({"master_weights": True}, 14), ({"master_weights": "remainder"}, 12),
                           ({"master_weights": "remainder", "state_dtype": torch.bfloat16}, 8),
                           ({"master_weights": "stochastic", "state_dtype": torch.bfloat16}, 6)):
        ps = [nn.Parameter(p.detach().clone()) for p in params]
        opt = _run(fo.AdamW, dict(lr=1e-3), ps, 1, **lean)
        held = sum(p.numel() * p.element_size() for p in ps)
        held += sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
                    if k != "step")
        assert held / n == expected, lean


#: A model with a weight above the 8-bit state's small-tensor rule (4096 elements) and small ones.
def _lean_model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 4)).to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_compiled_lean_step_matches_eager(state_dtype):
    def run(mode, backend=None):
        model = _lean_model()
        opt = fo.AdamW(model.parameters(), lr=torch.tensor(0.01), master_weights="remainder",
                       state_dtype=state_dtype, max_grad_norm=1.0)
        step = TrainStep(model, nn.MSELoss(), opt, mode=mode,
                         **({"compile_options": {"backend": backend}} if backend else {}))
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            step(torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 4, generator=g).bfloat16())
        return model, opt

    torch._dynamo.reset()
    try:
        eager, _ = run("off")
        cnt = CompileCounter()
        comp, opt = run("compile", cnt)
    finally:
        torch._dynamo.reset()
    assert cnt.frame_count == 2
    for a, b in zip(eager.parameters(), comp.parameters()):
        assert torch.equal(a, b)
    assert all(st["master_remainder"].dtype == torch.int16 for st in opt.state.values())
    assert any(st["exp_avg"].dtype == (torch.int8 if state_dtype == "int8" else torch.bfloat16)
               for st in opt.state.values())


@CUDA
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_captured_lean_step_matches_eager(state_dtype):
    def run(mode):
        model = _lean_model("cuda")
        opt = fo.AdamW(model.parameters(), lr=torch.tensor(0.01, device="cuda"), master_weights="stochastic",
                       state_dtype=state_dtype, max_grad_norm=1.0)
        step = TrainStep(model, nn.MSELoss(), opt, mode=mode)
        g = torch.Generator().manual_seed(5)
        for _ in range(5):
            x, y = torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)
            step(x.cuda().bfloat16(), y.cuda().bfloat16())
        return model

    for a, b in zip(run("off").parameters(), run("cuda_graph").parameters()):
        assert torch.equal(a, b)


# ---- bad settings ------------------------------------------------------------------------------------
def test_bad_lean_settings_are_refused_before_anything_changes():
    p16 = nn.Parameter(torch.randn(4, dtype=torch.float16))
    p64 = nn.Parameter(torch.randn(4, dtype=torch.float64))
    pb = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master_weights must be False, True, 'remainder' or 'stochastic'"):
        fo.AdamW([pb], master_weights="fp32")
    with pytest.raises(ValueError, match="state_dtype must be torch.float32, torch.bfloat16 or torch.int8"):
        fo.AdamW([pb], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="param 0 has dtype torch.float64; state_dtype=bfloat16"):
        fo.AdamW([p64], state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="param 0 is float16; master_weights='remainder' keeps bfloat16"):
        fo.AdamW([p16], master_weights="remainder")
    with pytest.raises(ValueError, match="is for the element-wise optimizers"):
        fo.Lamb([pb], master_weights="stochastic")
    opt = fo.AdamW([pb], master_weights="remainder")
    with pytest.raises(ValueError, match="param 0 is float16"):
        opt.add_param_group({"params": [p16]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="param group 1"):
        opt.add_param_group({"params": [p16], "state_dtype": "int4"})


def test_the_op_refuses_lean_lists_that_do_not_fit():
    pb = torch.randn(6).bfloat16()
    p16 = torch.randn(6).half()
    step = torch.zeros(())
    s = [torch.zeros(6), torch.zeros(6)]
    args = lambda p, master, masters, states: (  # noqa: E731
        "adam", [p], [torch.randn(6).to(p.dtype)], [step.clone()], [states[0]], [states[1]], [], masters, [], [1],
        [torch.tensor(0.1)], kind_record("adam", master=master, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8))
    before = pb.clone()
    with pytest.raises(ValueError, match="params\\[0\\] is float16 but the group's master_weights are remainders"):
        torch.ops.fusetrain.fused_step_(*args(p16, 2, [torch.zeros(6, dtype=torch.int16)], s))
    with pytest.raises(ValueError, match="master_weights must be 0 \\(none\\), 1"):
        torch.ops.fusetrain.fused_step_(*args(pb, 4, [], s))
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or int8"):
        torch.ops.fusetrain.fused_step_(*args(pb, 0, [], [torch.zeros(6, dtype=torch.float16)] * 2))
    with pytest.raises(RuntimeError, match="must be float32 \\(params"):
        torch.ops.fusetrain.fused_step_(*args(p16, 1, [torch.zeros(6, dtype=torch.int16)], s))
    with pytest.raises(RuntimeError, match="different dtypes"):
        torch.ops.fusetrain.fused_step_(*args(pb, 0, [], [s[0], s[1].bfloat16()]))
    assert torch.equal(pb, before)


def test_opcheck_lean_lists():
    pb = torch.randn(37).bfloat16()
    a = ("adam", [pb], [torch.randn(37).bfloat16()], [torch.zeros(())], [torch.zeros(37).bfloat16()],
         [torch.zeros(37).bfloat16()], [], [torch.zeros(37, dtype=torch.int16)], [], [1], [torch.tensor(0.1)],
         kind_record("adam", master=2, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8))
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default, a)


def test_a_lean_state_dict_into_an_optimizer_that_cannot_take_it_changes_nothing():
    params = _params("cpu", shapes=[(9,)])
    opt = _run(fo.AdamW, dict(lr=1e-2), params, 2, master_weights="remainder", state_dtype=torch.bfloat16)
    sd = opt.state_dict()
    wide = [nn.Parameter(torch.randn(9, dtype=torch.float64))]
    other = fo.AdamW(wide, lr=1e-2)
    with pytest.raises(ValueError, match="param 0 has dtype torch.float64; state_dtype=bfloat16"):
        other.load_state_dict(sd)
    assert not other.state and other.param_groups[0]["state_dtype"] == "float32"
    lamb = fo.Lamb([nn.Parameter(p.detach().clone()) for p in params])
    with pytest.raises(ValueError, match="is for the element-wise optimizers"):
        lamb.load_state_dict(sd)
    assert not lamb.state and lamb.param_groups[0]["master_weights"] is False
