"""8-bit optimizer state (NOTE [8-bit state] in csrc/common/lean_state.h): codes and block scales written
inside the fused step. The kernels' codes are checked bit for bit against the code map of
fusetrain.optim._int8_state applied to a float32 run's values with the kernels' random stream, the map
against its definition, the rounding for bias, and the whole step against a float64 reference."""

import copy
import math

import pytest
import torch
from torch import nn

import fusetrain.optim as fo
from fusetrain.optim import _int8_state as q8
from _lean_helpers import LEAN, LEAN_IDS, grads as _grads, rounding_bits as _rounding_bits, run as _run, \
    state_bits as _state_bits
from _test_helpers import CUDA, DEVICES, kind_record

#: Shapes at or above the small-tensor rule (one crossing a CPU work item and a CUDA chunk), and one below.
BIG = [(4096,), (65, 131), (70001,), (5000, 3)]
SMALL = (100,)


def _params(device, dtype=torch.float32, seed=0, shapes=BIG + [SMALL]):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device=device, dtype=dtype)) for s in shapes]


def _values(opt, p, name):
    """A state as float32 values (decoded when int8)."""
    st = opt.state[p]
    v = st[name]
    return q8.dequantize(v, st[q8.scales_key(name)]) if v.dtype == torch.int8 else v.float()


# ---- the code map --------------------------------------------------------------------------------
def _grid(unsigned):
    """Every value a code of a map stands for, for a block scale of 1 (codes in order)."""
    scale = torch.tensor([-1.0 if unsigned else 1.0])
    codes = torch.arange(256 if unsigned else 128, dtype=torch.int64).to(torch.uint8).view(torch.int8)
    return q8.decode(codes, scale.expand(codes.numel()).contiguous(), 1)


@pytest.mark.parametrize("unsigned", [True, False])
def test_the_code_maps_are_e5m3_and_sign_e4m3(unsigned):
    v = _grid(unsigned).double()
    assert torch.all(v[1:] > v[:-1])  # strictly increasing with the code
    ebits, low = (5, -30) if unsigned else (4, -14)
    expected = [m * 2.0 ** (low - 3) for m in range(8)]  # the linear steps below the normal range
    for e in range(1, 2 ** ebits):
        expected += [(1 + m / 8) * 2.0 ** (low + e - 1) for m in range(8)]
    assert torch.equal(v, torch.tensor(expected[:v.numel()], dtype=torch.float64))
    if not unsigned:  # the sign bit mirrors the magnitudes
        neg = q8.decode(torch.arange(128, 256).to(torch.uint8).view(torch.int8), torch.ones(128), 1)
        assert torch.equal(neg, -v.float())


def test_nearest_encoding_picks_the_closest_code_and_decodes_to_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50 * 256, generator=g) * 10.0 ** torch.randint(-6, 3, (50 * 256,), generator=g).float()
    x[:256] = x[:256].abs()  # one block with no negative value: the unsigned map
    codes, scales = q8.encode(x, 256)
    assert scales[0] < 0 and torch.all(scales[1:] > 0)
    assert torch.equal(scales.abs(), x.view(50, 256).abs().amax(dim=1))
    back = q8.decode(codes, scales, 256)
    # Each value goes to a neighbouring code: the error is at most one code step (1/8 of the value's binade).
    err = (back - x).abs()
    assert torch.all(err <= x.abs() / 8 + scales.abs().repeat_interleave(256) * 2.0 ** -17)
    assert torch.equal(q8.decode(*q8.encode(back, 256), 256), back)  # decoded values encode to themselves


def test_special_blocks():
    x = torch.zeros(3 * 64)
    x[64:128] = -0.0
    x[130] = float("nan")
    x[140] = float("inf")
    codes, scales = q8.encode(x, 64)
    assert scales[0].item() == 0.0 and math.copysign(1, scales[0].item()) == -1  # all >= 0: unsigned map, -0
    assert torch.isnan(scales[2]) and torch.all(codes[128:] == 0)
    back = q8.decode(codes, scales, 64)
    assert torch.all(back[:128] == 0) and torch.all(torch.isnan(back[128:]))

    tiny = torch.zeros(64)
    tiny[5] = 1e-39  # below float32's smallest normal: the block is stored as zeros (its reciprocal overflows)
    codes, scales = q8.encode(tiny, 64)
    assert torch.all(codes == 0) and scales[0].item() == 0.0


def test_stochastic_encoding_is_unbiased():
    # Values between codes, in the normal and the linear range of both maps: the mean of the decoded
    # values converges to the value, the fraction rounded up to the distance from the lower code.
    n = 1 << 16
    for value, unsigned in ((0.3, True), (0.3, False), (3e-10, True), (2e-5, False)):
        block = torch.full((n,), value)
        block[0] = 1.0  # the block's largest magnitude: the scale is 1
        if not unsigned:
            block[1] = -1.0
        rnd = _rounding_bits(3, 0, 1, n)
        codes, scales = q8.encode(block, n, rnd)
        back = q8.decode(codes, scales, n)[2:].double()
        grid = _grid(unsigned).double()
        lo = grid[grid <= value].max()
        hi = grid[grid > value].min()
        p_up = (value - lo) / (hi - lo)
        assert set(back.unique().tolist()) <= {lo.item(), hi.item()}
        sigma = math.sqrt(p_up * (1 - p_up) / back.numel()) * (hi - lo)
        assert abs(back.mean().item() - value) < 5 * sigma, (value, unsigned)


# ---- the kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("cls,kw", LEAN, ids=LEAN_IDS)
def test_int8_state_is_the_code_map_of_the_float32_step(cls, kw, block):
    """From the same values, a float32-state step gives the values before quantisation; the int8 run
    stores exactly their codes with the stream of (step, tensor, slot, element) and the block scales,
    and the params match bit for bit. The small tensor keeps float32 state (the small-tensor rule)."""
    lean = _params("cpu")
    b = _run(cls, kw, lean, 2, state_dtype="int8", state_block_size=block)
    wide = [nn.Parameter(p.detach().clone()) for p in lean]
    a = cls(wide, **kw)
    names = [n for n in b._state_names(b.param_groups[0]) if n is not None and n not in b._scalar_states]
    for p, q in zip(wide, lean):
        a.state[p] = {k: v.clone() for k, v in b.state[q].items() if not k.endswith("_scales")}
        for name in names:
            a.state[p][name] = _values(b, q, name)
    for opt, ps in ((a, wide), (b, lean)):
        for p, g in zip(ps, _grads(ps, 30)):
            p.grad = g
        opt.step()
    assert b.state[lean[-1]][names[0]].dtype == torch.float32  # below MIN_NUMEL
    for t, (p, q) in enumerate(zip(wide[:-1], lean[:-1])):  # the int8 tensors, in their launch's order
        assert torch.equal(p, q), t
        for name in names:
            slot = list(b._state_names(b.param_groups[0])).index(name)
            codes, scales = q8.encode(a.state[p][name], block, _state_bits(3, t, slot, p.numel()))
            assert torch.equal(b.state[q][name].reshape(-1), codes), (t, name)
            assert torch.equal(b.state[q][q8.scales_key(name)].view(torch.int32), scales.view(torch.int32))


def _adamw_float64(params, grads_per_step, lr, betas, eps, wd, block):
    """AdamW with int8 moments in float64: each step decodes the moments, updates in float64 and encodes
    them again with the kernels' stream (its codes are those of the float64 values)."""
    ref = [p.detach().double().clone() for p in params]
    st = [{n: q8.encode(torch.zeros(p.numel()), block) for n in ("exp_avg", "exp_avg_sq")} for p in params]
    for k, grads in enumerate(grads_per_step, start=1):
        for t, (w, g, s) in enumerate(zip(ref, grads, st)):
            g = g.double().reshape(-1)
            m = q8.decode(*s["exp_avg"], block).double() * betas[0] + (1 - betas[0]) * g
            v = q8.decode(*s["exp_avg_sq"], block).double() * betas[1] + (1 - betas[1]) * g * g
            w.mul_(1 - lr * wd)
            denom = (v / (1 - betas[1] ** k)).sqrt() + eps
            w.add_(-(lr / (1 - betas[0] ** k)) * (m / denom).reshape(w.shape))
            s["exp_avg"] = q8.encode(m.float(), block, _state_bits(k, t, 0, m.numel()))
            s["exp_avg_sq"] = q8.encode(v.float(), block, _state_bits(k, t, 1, v.numel()))
    return ref, st


@pytest.mark.parametrize("device", DEVICES)
def test_int8_adamw_follows_a_float64_reference_of_the_same_algorithm(device):
    params = _params(device, shapes=BIG)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    steps = 6
    grads = [_grads(params, 40 + k) for k in range(steps)]
    opt = fo.AdamW(params, **kw, state_dtype="int8", state_block_size=128)
    ref, st = _adamw_float64([p.cpu() for p in params], [[g.cpu() for g in gs] for gs in grads], kw["lr"],
                             kw["betas"], kw["eps"], kw["weight_decay"], 128)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
    for p, w, s in zip(params, ref, st):
        # The params and codes agree except where float32 and float64 values fell on either side of a
        # rounding threshold (about one element in a million a step and state): at most a few in ten
        # thousand, codes one apart and params within the effect of one code step on lr-sized updates.
        got_p = p.detach().cpu().double()
        assert (~torch.isclose(got_p, w, rtol=1e-5, atol=1e-6)).float().mean() < 1e-3
        torch.testing.assert_close(got_p, w, rtol=0, atol=0.2 * kw["lr"])
        for name in ("exp_avg", "exp_avg_sq"):
            got = opt.state[p][name].cpu().reshape(-1).view(torch.uint8).int()
            want = s[name][0].view(torch.uint8).int()
            assert (got != want).float().mean() < 1e-3, name
            assert torch.all((got - want).abs() <= 1) or name == "exp_avg", name


def test_int8_moments_keep_decaying():
    # Zero gradients: SGD's momentum buffer decays by 0.9 a step, Adam's exp_avg_sq by beta2; rounded to
    # nearest, a code would stall. Stochastic rounding keeps the mean on the exact decay.
    p = nn.Parameter(torch.ones(1 << 16))
    opt = fo.Adam([p], lr=1e-9, betas=(0.9, 0.99), state_dtype="int8")
    g = torch.Generator().manual_seed(0)
    p.grad = torch.rand(p.shape, generator=g) + 0.5
    opt.step()
    v1 = _values(opt, p, "exp_avg_sq").double()
    p.grad = torch.zeros_like(p)
    for _ in range(200):
        opt.step()
    ratio = _values(opt, p, "exp_avg_sq").double().sum() / v1.sum()
    assert abs(ratio.item() / 0.99 ** 200 - 1) < 0.02


def test_a_block_below_the_smallest_normal_is_stored_as_zeros():
    # Gradients of 1e-20: exp_avg_sq's values are about 1e-43, its blocks stored as zeros (scale -0); the
    # mirror encodes the float32 step's values the same way.
    p = nn.Parameter(torch.ones(4096))
    opt = fo.Adam([p], lr=1e-3, state_dtype="int8", state_block_size=64)
    p.grad = torch.full_like(p, 1e-20)
    opt.step()
    st = opt.state[p]
    assert torch.all(st["exp_avg_sq"] == 0)
    assert torch.equal(st["exp_avg_sq_scales"], torch.full((64,), -0.0))
    assert torch.all(st["exp_avg"] != 0)  # 1e-21: normal, kept
    codes, scales = q8.encode(torch.full((4096,), 1e-20 * 1e-20 * (1 - 0.999)), 64)
    assert torch.equal(codes, st["exp_avg_sq"]) and torch.equal(scales, st["exp_avg_sq_scales"])


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_stores_blocks_with_special_values_as_the_code_map_does(device):
    # Gradients with a NaN, a negative NaN, an infinity of each sign, zeros of both signs and a block of
    # zeros: the kernel's block scales (a non-finite block's NaN, an all-zero block's -0) and codes are the
    # code map's of the float32 step's values, and the blocks beside them round as usual.
    block, n = 64, 72 * 64  # at or above the small-tensor rule
    g = torch.randn(n, generator=torch.Generator().manual_seed(5))
    g[3] = float("nan")
    g[70] = -float("nan")
    g[140] = float("inf")
    g[200] = -float("inf")
    g[260:264] = -0.0
    g[320:384] = 0.0
    lean, wide = (nn.Parameter(torch.ones(n, device=device)) for _ in range(2))
    b = fo.Adam([lean], lr=1e-3, state_dtype="int8", state_block_size=block)
    a = fo.Adam([wide], lr=1e-3)
    for opt, p in ((a, wide), (b, lean)):
        p.grad = g.to(device)
        opt.step()
    for slot, name in enumerate(("exp_avg", "exp_avg_sq")):
        codes, scales = q8.encode(a.state[wide][name].cpu(), block, _state_bits(1, 0, slot, n))
        assert torch.equal(b.state[lean][name].cpu(), codes), name
        assert torch.equal(b.state[lean][q8.scales_key(name)].cpu().view(torch.int32), scales.view(torch.int32)), name
    assert torch.isnan(b.state[lean]["exp_avg_scales"][:4]).all()  # blocks 0..3 hold a NaN or an infinity
    assert b.state[lean]["exp_avg_sq_scales"][5].item() == 0.0  # the block of zeros


def test_flushing_subnormals_leaves_the_int8_codes():
    # torch.set_flush_denormal(True) flushes fp32 subnormals in the calling thread; the CPU encode and
    # decode work on them (NOTE [q8 subnormals]) and keep them, so the codes of the linear range (second
    # moments 2^-30 of their block's largest and below) are those of a run without flushing.
    def run(flush):
        g = torch.Generator().manual_seed(3)
        p = nn.Parameter(torch.randn(8192, generator=g))
        opt = fo.Adam([p], lr=1e-3, state_dtype="int8", state_block_size=128)
        for k in range(3):
            p.grad = torch.randn(8192, generator=g) * torch.logspace(-9, 0, 8192)[torch.randperm(8192, generator=g)]
            supported = torch.set_flush_denormal(flush)
            try:
                opt.step()
            finally:
                torch.set_flush_denormal(False)
        assert supported, "this CPU has no flush flags"
        return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the flags are the kernel's thread's
    try:
        kept, flushed = run(False), run(True)
    finally:
        torch.set_num_threads(threads)
    linear = (kept[2] > 0) & (kept[2] < 8)  # codes of the unsigned map's linear range
    assert linear.sum() > 100
    for a, b in zip(kept, flushed):
        assert torch.equal(a, b)


def test_int8_state_bytes_per_param():
    params = [nn.Parameter(torch.randn(s).bfloat16()) for s in ((1 << 16,), (256, 300))]
    n = sum(p.numel() for p in params)
    for lean, target in (({"master_weights": "remainder"}, 6.1), ({"master_weights": "stochastic"}, 4.1)):
        ps = [nn.Parameter(p.detach().clone()) for p in params]
        opt = _run(fo.AdamW, dict(lr=1e-3), ps, 1, state_dtype="int8", **lean)
        held = sum(p.numel() * p.element_size() for p in ps)
        held += sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k != "step")
        assert held / n <= target, (lean, held / n)
        assert held / n == 2 + 2 * (1 + 4 / 256) + (2 if lean["master_weights"] == "remainder" else 0)


# ---- state dicts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_int8_runs_resume_exactly(device):
    params = _params(device, dtype=torch.bfloat16)
    twin = [nn.Parameter(p.detach().clone()) for p in params]
    lean = dict(master_weights="remainder", state_dtype="int8", max_grad_norm=1.0)
    a = _run(fo.AdamW, dict(lr=1e-2), params, 5, **lean)
    b = _run(fo.AdamW, dict(lr=1e-2), twin, 3, **lean)
    saved = copy.deepcopy(b.state_dict())
    resumed = [nn.Parameter(p.detach().clone()) for p in twin]
    c = fo.AdamW(resumed, lr=1e-2, **lean)
    c.load_state_dict(saved)
    for k in range(3, 5):
        for p, g in zip(resumed, _grads(resumed, 1 + k)):
            p.grad = g
        c.step()
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
        for name, v in a.state[p].items():
            assert torch.equal(v, c.state[q][name]), name


def test_state_dicts_convert_between_float32_and_int8():
    params = _params("cpu", shapes=BIG[:2])
    full = _run(fo.AdamW, dict(lr=1e-2), [nn.Parameter(p.detach().clone()) for p in params], 3)
    # A float32 (or torch.optim) state dict into an int8 optimizer: quantised when loaded, to nearest.
    ps = [nn.Parameter(p.detach().clone()) for p in params]
    lean = fo.AdamW(ps, lr=1e-2, state_dtype="int8", state_block_size=64)
    lean.load_state_dict(full.state_dict())
    for p, q in zip(full.param_groups[0]["params"], ps):
        for name in ("exp_avg", "exp_avg_sq"):
            codes, scales = q8.encode(full.state[p][name], 64)
            assert torch.equal(lean.state[q][name].reshape(-1), codes)
            assert torch.equal(lean.state[q][q8.scales_key(name)], scales)
    # And back: full_precision_state_dict decodes an int8 state dict, for a float32 optimizer or torch.optim.
    sd = fo.full_precision_state_dict(lean.state_dict())
    back = fo.AdamW([nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    back.load_state_dict(sd)
    assert back.param_groups[0]["state_dtype"] == "float32"
    assert all(torch.equal(back.state_dict()["state"][i][k], v) for i, st in sd["state"].items()
               for k, v in st.items())
    assert all(not k.endswith("_scales") and (v.dtype == torch.float32) for st in sd["state"].values()
               for k, v in st.items())
    for i, q in enumerate(ps):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][name], _values(lean, q, name))
    ref = torch.optim.AdamW([nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    ref.load_state_dict(sd)


def test_changing_the_block_size_or_the_form_converts_at_the_next_step():
    params = _params("cpu", shapes=BIG[:1])
    opt = _run(fo.AdamW, dict(lr=1e-2), params, 2, state_dtype="int8", state_block_size=256)
    before = _values(opt, params[0], "exp_avg")
    opt.param_groups[0]["state_block_size"] = 64
    opt.init_state()
    assert opt.state[params[0]]["exp_avg_scales"].numel() == 4096 // 64
    torch.testing.assert_close(_values(opt, params[0], "exp_avg"), before, rtol=1 / 16, atol=1e-7)
    opt.param_groups[0]["state_dtype"] = "float32"
    opt.init_state()
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32 and "exp_avg_scales" not in opt.state[params[0]]


# ---- the rest of the step still holds (compiled and captured: test_lean_state.py) ---------------------
@CUDA
@pytest.mark.parametrize("block", [64, 256])
@pytest.mark.parametrize("cls,kw", LEAN, ids=LEAN_IDS)
def test_cuda_int8_step_matches_cpu(cls, kw, block):
    cpu = _params("cpu", dtype=torch.bfloat16)
    gpu = [nn.Parameter(p.detach().cuda()) for p in cpu]
    lean = dict(master_weights="remainder", state_dtype="int8", state_block_size=block, max_grad_norm=2.0)
    a = _run(cls, kw, cpu, 3, **lean)
    b = _run(cls, kw, gpu, 3, **lean)
    for p, q in zip(cpu, gpu):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-2, atol=1e-5)
        for name, v in a.state[p].items():
            if v.dtype == torch.int8:
                torch.testing.assert_close(_values(b, q, name).cpu(), _values(a, p, name), rtol=0.07, atol=1e-6)


@CUDA
@pytest.mark.parametrize("master", ["remainder", True, "stochastic"])
def test_cuda_int8_lanes_on_unaligned_views_match_aligned_params(master):
    # NOTE [q8 lanes on CUDA]: params that are views at an odd offset into one buffer (and their EMA)
    # take the lanes' element-by-element accesses; aligned copies take the 16-byte ones: the same bits.
    shapes = [(70001,), (65, 131), (4096,)]
    flat = torch.randn(3 + sum(math.prod(s) for s in shapes), device="cuda").bfloat16()
    views, at = [], 3
    for s in shapes:
        views.append(nn.Parameter(flat[at:at + math.prod(s)].view(s)))
        at += math.prod(s)
    aligned = [nn.Parameter(v.detach().clone()) for v in views]
    lean = dict(lr=1e-2, weight_decay=0.1, master_weights=master, state_dtype="int8", state_block_size=128)
    runs = []
    for ps in (views, aligned):
        opt = fo.AdamW(ps, **lean)
        ema = [p.detach().clone() for p in ps]
        rems = [torch.zeros_like(p, dtype=torch.int16) for p in ps]
        opt.attach_ema(dict(zip(ps, ema)), torch.tensor(0.9, device="cuda"), remainders=dict(zip(ps, rems)))
        for k in range(3):
            for p, g in zip(ps, _grads(ps, 50 + k)):
                p.grad = g
            opt.step()
        runs.append((opt, ps, ema, rems))
    (a, pa, ea, ra), (b, pb, eb, rb) = runs
    for p, q, e, f, r, u in zip(pa, pb, ea, eb, ra, rb):
        assert torch.equal(p, q) and torch.equal(e, f) and torch.equal(r, u)
        for name, v in a.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert torch.equal(v, b.state[q][name]), name


def _q8_kernel_names(step):
    """The names of the 8-bit update kernels that ``step()`` launches."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "fused_update_q8_kernel" in e.name}


@CUDA
@pytest.mark.parametrize("layout", ["remainder", "remainder_ema", "stochastic", "nearest"])
@pytest.mark.parametrize("cls,kw", LEAN, ids=LEAN_IDS)
def test_cuda_int8_fixed_forms_match_the_general_instance(cls, kw, layout, monkeypatch):
    # NOTE [q8 forms]: with FUSETRAIN_Q8_FORMS=1, the tensors whose lanes are all whole take a fixed form
    # (lengths that are multiples of 8: a second chunk of 136 elements, whose last warp has empty lanes and
    # whose second block of 128 has one lane; a chunk ending on a warp; one with a single lane in its last
    # warp) and the rest the general instance (odd lengths, a view at an odd offset; the small tensor keeps
    # float32 state): every bit as the general instance alone writes it, over steps that clip and count.
    flat = torch.randn(3 + 8200, device="cuda").bfloat16()
    shapes = [(65536 + 136,), (4096,), (4104,), (70001,), (65, 131), (100,)]
    master = {"remainder": "remainder", "remainder_ema": "remainder", "stochastic": "stochastic",
              "nearest": False}[layout]
    runs, names = [], []
    for forms in (False, True):
        if forms:
            monkeypatch.setenv("FUSETRAIN_Q8_FORMS", "1")
        else:
            monkeypatch.delenv("FUSETRAIN_Q8_FORMS", raising=False)
        g = torch.Generator().manual_seed(7)
        ps = [nn.Parameter((torch.randn(s, generator=g) * 0.5).bfloat16().cuda()) for s in shapes]
        ps.append(nn.Parameter(flat.clone()[3:]))  # 8200 elements at an odd offset
        opt = cls(ps, **kw, master_weights=master, state_dtype="int8", state_block_size=128, max_grad_norm=2.0)
        ema, rems = [], []
        if layout == "remainder_ema":
            ema = [p.detach().clone() for p in ps]
            rems = [torch.zeros_like(p, dtype=torch.int16) for p in ps]
            opt.attach_ema(dict(zip(ps, ema)), torch.tensor(0.9, device="cuda"), remainders=dict(zip(ps, rems)))
        stalled = opt.track_stalled_updates() if master in ("stochastic", False) else None
        for k in range(3):
            for p, gr in zip(ps, _grads(ps, 60 + k)):
                p.grad = gr
            if k < 2:
                opt.step()
            else:
                names.append(_q8_kernel_names(opt.step))
        runs.append((opt, ps, ema, rems, stalled))
    (a, pa, ea, ra, sa), (b, pb, eb, rb, sb) = runs
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for name, v in a.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert torch.equal(v, b.state[q][name]), name
    for x, y in zip(ea + ra, eb + rb):
        assert torch.equal(x, y)
    if sa is not None:
        assert torch.equal(sa, sb)
    assert len(names[0]) == 1 and len(names[1]) == 2, names  # the general instance; a fixed form beside it


@CUDA
def test_cuda_int8_fixed_forms_switch_with_another_value_warns_and_stays_off(monkeypatch):
    monkeypatch.setenv("FUSETRAIN_Q8_FORMS", "yes")
    p = nn.Parameter(torch.randn(4096, device="cuda").bfloat16())
    p.grad = torch.randn_like(p)
    opt = fo.AdamW([p], master_weights="remainder", state_dtype="int8")
    # TORCH_WARN_ONCE warns once per process unless warn-always is on: on, the test passes on a rerun and after
    # another case of the same worker warned.
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with pytest.warns(UserWarning, match="FUSETRAIN_Q8_FORMS='yes' is neither 0 nor 1"):
            opt.step()
            names = _q8_kernel_names(opt.step)
    finally:
        torch.set_warn_always(was)
    assert len(names) == 1  # the general instance alone


# ---- bad settings ------------------------------------------------------------------------------------
def test_bad_int8_settings_are_refused_before_anything_changes():
    p64 = nn.Parameter(torch.randn(5000, dtype=torch.float64))
    p = nn.Parameter(torch.randn(5000))
    with pytest.raises(ValueError, match="param 0 has dtype torch.float64; state_dtype=int8"):
        fo.AdamW([p64], state_dtype="int8")
    with pytest.raises(ValueError, match="state_block_size must be a power of two .* got 100 \\(not a power of two"):
        fo.AdamW([p], state_dtype="int8", state_block_size=100)
    with pytest.raises(ValueError, match="got 512 \\(out of range\\)"):
        fo.AdamW([p], state_dtype="int8", state_block_size=512)
    with pytest.raises(TypeError, match="state_block_size must be an int"):
        fo.AdamW([p], state_block_size=128.0)
    opt = _run(fo.AdamW, dict(lr=1e-2), [p], 1, state_dtype="int8")
    sd = opt.state_dict()
    other = fo.AdamW([p64], lr=1e-2)
    with pytest.raises(ValueError, match="state_dtype=int8"):
        other.load_state_dict(sd)
    assert not other.state and other.param_groups[0]["state_dtype"] == "float32"
    lamb = fo.Lamb([nn.Parameter(torch.randn(5000))])
    with pytest.raises(ValueError, match="is for the element-wise optimizers"):
        lamb.load_state_dict(sd)
    assert not lamb.state


def _op_args(codes, scales, record=None):
    p = torch.randn(5000)
    return ("adam", [p], [torch.randn(5000)], [torch.zeros(())], [codes[0]], [codes[1]], [], [], [], [1],
            [torch.tensor(0.1)], record or kind_record("adam", betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8)), p


def test_the_op_refuses_int8_lists_that_do_not_fit():
    codes = [torch.zeros(5000, dtype=torch.int8), torch.zeros(5000, dtype=torch.int8)]
    good = [torch.zeros(20), torch.zeros(20)]  # blocks of 256
    args, p = _op_args(codes, good)
    before = p.clone()
    with pytest.raises(ValueError, match="state_scales has 0 tensors but the int8 state tensors need 2"):
        torch.ops.fusetrain.fused_step_(*args)
    with pytest.raises(RuntimeError, match="has 5000 elements and 21 block scales; blocks of 64, 128 or 256"):
        torch.ops.fusetrain.fused_step_(*args, state_scales=[torch.zeros(20), torch.zeros(21)])
    with pytest.raises(RuntimeError, match="must be a contiguous 1-D float32 tensor"):
        torch.ops.fusetrain.fused_step_(*args, state_scales=[torch.zeros(20).double(), torch.zeros(20)])
    with pytest.raises(ValueError, match="state_scales has 3 tensors but the int8 state tensors need 2"):
        torch.ops.fusetrain.fused_step_(*args, state_scales=good + [torch.zeros(20)])
    with pytest.raises(RuntimeError, match="have different block sizes"):
        torch.ops.fusetrain.fused_step_(*args, state_scales=[torch.zeros(20), torch.zeros(40)])
    assert torch.equal(p, before)
    torch.ops.fusetrain.fused_step_(*args, state_scales=good)
    assert not torch.equal(p, before)


def test_opcheck_int8_lists():
    codes = [torch.zeros(5000, dtype=torch.int8), torch.zeros(5000, dtype=torch.int8)]
    args, _ = _op_args(codes, None)
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default, args,
                          {"state_scales": [torch.zeros(79), torch.zeros(79)]})
