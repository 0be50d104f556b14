"""fusetrain::fused_step_ (the whole optimizer tail over every group) and the EMA
ops ema_decay_ / ema_step_, against references built from one group per call
and plain torch, on random inputs."""

import math

import pytest
import torch

import fusetrain  # noqa: F401
from _optim_helpers import decay_reference
from _test_helpers import CUDA, DEVICES, kind_record, kind_step
from fusetrain import _ops

SEED = 4321
LOW = (torch.float16, torch.bfloat16)


def rand(shape, dtype, device):
    return torch.randn(shape, device=device).to(dtype)


def adam_group(device, shapes, dtypes, *, clip=0.0, master=False, ema=False, amsgrad=False, decoupled=True,
               maximize=False, lr=0.01):
    params = [rand(s, dt, device) for s, dt in zip(shapes, dtypes)]
    g = {
        "params": params,
        "grads": [rand(s, dt, device) * 3 for s, dt in zip(shapes, dtypes)],
        "steps": [torch.full((), 2.0, device=device) for _ in shapes],
        "s": [[torch.randn(s, device=device) * 0.1 for s in shapes],
              [torch.rand(s, device=device) * 0.01 for s in shapes],
              [torch.rand(s, device=device) * 0.02 for s in shapes] if amsgrad else []],
        "masters": [p.float() + 1e-3 * torch.randn(p.shape, device=device) for p in params
                    if master and p.dtype != torch.float32],
        "emas": [rand(s, dt, device) for s, dt in zip(shapes, dtypes)] if ema else [],
        "lr": torch.tensor(lr, device=device),
        "hyper": kind_record("adam", max_grad_norm=clip, master=master, ema=ema, maximize=maximize, betas=(0.9, 0.99),
                             weight_decay=0.05, eps=1e-8, amsgrad=amsgrad, decoupled_weight_decay=decoupled),
    }
    return g


def clone_group(g):
    c = dict(g)
    for k in ("params", "grads", "steps", "masters", "emas"):
        c[k] = [t.clone() for t in g[k]]
    c["s"] = [[t.clone() for t in lst] for lst in g["s"]]
    return c


def run_fused_step(groups, **tail):
    cat = lambda key: [t for g in groups for t in g[key]]  # noqa: E731
    device = groups[0]["params"][0].device
    out = {"grad_norm_out": torch.zeros((), device=device), "found_inf_out": torch.zeros((), device=device)}
    _ops.fused_step_("adam", cat("params"), cat("grads"), cat("steps"), [t for g in groups for t in g["s"][0]],
                     [t for g in groups for t in g["s"][1]], [t for g in groups for t in g["s"][2]], cat("masters"),
                     cat("emas"), [len(g["params"]) for g in groups], [g["lr"] for g in groups],
                     [h for g in groups for h in g["hyper"]], **tail, **out)
    return out


def run_reference(groups, inv_scale=None, found_inf=None, ema_decay=None):
    """The same tail one group at a time: global stats, then one fused_step_
    call per group with the global norm and flag given."""
    clips = any(g["hyper"][0] > 0 for g in groups)
    norm, flag = None, found_inf
    if clips or (inv_scale is not None and found_inf is None):
        norm, f = _ops.grad_stats([t for g in groups for t in g["grads"]], inv_scale)
        flag = f if flag is None else torch.maximum(flag, f)
    for g in groups:
        clip = g["hyper"][0]
        _ops.fused_step_("adam", g["params"], g["grads"], g["steps"], *g["s"], g["masters"], g["emas"],
                         [len(g["params"])], [g["lr"]], g["hyper"], inv_scale=inv_scale, found_inf=flag,
                         ema_decay=ema_decay if g["emas"] else None, grad_norm=norm if clip > 0 else None)
    return norm, flag


def assert_groups_equal(a, b):
    for ga, gb in zip(a, b):
        for k in ("params", "steps", "masters", "emas"):
            for x, y in zip(ga[k], gb[k]):
                assert torch.equal(x, y), k
        for la, lb in zip(ga["s"], gb["s"]):
            for x, y in zip(la, lb):
                assert torch.equal(x, y)


def make_groups(device):
    return [
        adam_group(device, [(7,), (13, 5)], [torch.float32, torch.bfloat16], clip=0.5, master=True, ema=True),
        adam_group(device, [(1031,), (3, 3, 3)], [torch.float16, torch.float32], amsgrad=True, decoupled=False,
                   maximize=True, lr=0.003),
        adam_group(device, [(2,)], [torch.float32], ema=True),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tail", ["plain", "scaled", "flag_given", "inf"])
def test_matches_one_group_per_call(device, tail):
    groups = make_groups(device)
    inv = torch.tensor(1 / 64.0, device=device)
    decay = torch.tensor(0.95, device=device)
    kwargs = {"ema_decay": decay}
    if tail in ("scaled", "inf"):
        kwargs["inv_scale"] = inv
    if tail == "flag_given":
        kwargs["found_inf"] = torch.zeros((), device=device)
    if tail == "inf":
        groups[1]["grads"][0][5] = float("inf")
    ref = [clone_group(g) for g in groups]
    out = run_fused_step(groups, **kwargs)
    norm, flag = run_reference(ref, **kwargs)
    assert_groups_equal(groups, ref)
    # A group clips, so the norm over every group's gradients is measured.
    assert torch.equal(out["grad_norm_out"], norm) or (norm.isinf() and out["grad_norm_out"].isinf())
    assert out["found_inf_out"].item() == (1.0 if tail == "inf" else 0.0)
    assert torch.equal(out["found_inf_out"], flag)
    if tail == "inf":  # a skipped step changed nothing, step counters included
        assert all(s.item() == 2.0 for g in groups for s in g["steps"])


@pytest.mark.parametrize("device", DEVICES)
def test_a_given_norm_is_the_clipping_norm(device):
    # A caller's global norm (sharded params: the norm over every rank's shards) replaces the stats pass's.
    g = adam_group(device, [(7,), (13, 5)], [torch.float32, torch.float32], clip=0.5)
    ref = clone_group(g)
    given = torch.tensor(7.5, device=device)
    out = run_fused_step([g], grad_norm=given)
    # The reference: gradients clipped by hand with the given norm, no clipping in the step.
    coef = 0.5 / (7.5 + 1e-6)
    kind_step("adam", ref["params"], [gr * coef for gr in ref["grads"]], ref["steps"], ref["s"][:2], lr=ref["lr"],
              betas=(0.9, 0.99), weight_decay=0.05, eps=1e-8, decoupled_weight_decay=True)
    for k in ("params", "steps"):
        for x, y in zip(g[k], ref[k]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    assert torch.equal(out["grad_norm_out"], given) and out["found_inf_out"].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_no_measurement_leaves_nan_norm_and_zero_flag(device):
    g = adam_group(device, [(5,)], [torch.float32])  # no clipping, no loss scale
    out = run_fused_step([g])
    assert math.isnan(out["grad_norm_out"].item())
    assert out["found_inf_out"].item() == 0.0


def test_bad_records_name_the_argument():
    g = adam_group("cpu", [(5,)], [torch.float32])
    lists = ([t for t in g["params"]], g["grads"], g["steps"], g["s"][0], g["s"][1], [], [], [])
    kinds = "'adadelta', 'adam', 'adamp', 'lamb', 'lion', 'muon', 'nadam', 'radam', 'rmsprop', 'sgd'"
    with pytest.raises(ValueError, match=f"optimizer must be one of {kinds}, got 'adamw'"):
        _ops.fused_step_("adamw", *lists, [1], [g["lr"]], g["hyper"])
    with pytest.raises(ValueError, match="takes 11 hyper values per group"):
        _ops.fused_step_("adam", *lists, [1], [g["lr"]], g["hyper"][:-1])
    with pytest.raises(ValueError, match="got 1 group_sizes but 2 lrs"):
        _ops.fused_step_("adam", *lists, [1], [g["lr"], g["lr"]], g["hyper"])
    with pytest.raises(ValueError, match="params has 1 tensors, fewer than the group records need"):
        _ops.fused_step_("adam", *lists, [2], [g["lr"]], g["hyper"])
    with pytest.raises(ValueError, match="params has 1 tensors but the group records use 0"):
        _ops.fused_step_("adam", *lists, [0], [g["lr"]], g["hyper"])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_fused_step(device):
    groups = make_groups(device)
    cat = lambda key: [t for g in groups for t in g[key]]  # noqa: E731
    args = ("adam", cat("params"), cat("grads"), cat("steps"), [t for g in groups for t in g["s"][0]],
            [t for g in groups for t in g["s"][1]], [t for g in groups for t in g["s"][2]], cat("masters"),
            cat("emas"), [len(g["params"]) for g in groups], [g["lr"] for g in groups],
            [h for g in groups for h in g["hyper"]])
    kwargs = {"inv_scale": torch.tensor(0.5, device=device), "ema_decay": torch.tensor(0.9, device=device),
              "grad_norm_out": torch.zeros((), device=device), "found_inf_out": torch.zeros((), device=device)}
    torch.library.opcheck(torch.ops.fusetrain.fused_step_, args, kwargs)
    sgd = adam_group(device, [(4,)], [torch.float32])
    torch.library.opcheck(torch.ops.fusetrain.fused_step_,
                          ("sgd", sgd["params"], sgd["grads"], sgd["steps"], [], [], [], [], [], [1], [sgd["lr"]],
                           kind_record("sgd", momentum=0.0, weight_decay=0.01)), {})


# ---- ema_decay_ --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decay_type", ["constant", "threshold", "exp"])
@pytest.mark.parametrize("warmup", [False, True])
def test_ema_decay_matches_the_schedule(device, decay_type, warmup):
    out = torch.zeros((), device=device)
    total = torch.tensor(1000.0, device=device)
    for step in [0.0, 1.0, 7.0, 123.0, 999.0]:
        _ops.ema_decay_(out, torch.tensor(step, device=device), total, decay_type, 0.9998, 15.0, warmup, 2.0, 0.75)
        expected = decay_reference(step, decay_type, 0.9998, 15.0, 1000.0, warmup, 2.0, 0.75)
        assert out.item() == pytest.approx(expected, rel=2e-6, abs=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_ema_decay_takes_one_element_tensors_of_any_shape_and_a_total_on_the_host(device):
    out, step = torch.zeros(1, device=device), torch.full((1, 1), 41.0, device=device)
    total = torch.tensor(500.0)  # on the host: moved to the step's device
    _ops.ema_decay_(out, step, total, "exp", 0.999, 15.0, True, 1.0, 0.75)
    expected = decay_reference(41.0, "exp", 0.999, 15.0, 500.0, True, 1.0, 0.75)
    assert out.shape == (1,) and out.item() == pytest.approx(expected, rel=2e-6)
    assert step.item() == 41.0 and total.item() == 500.0


@CUDA
@pytest.mark.parametrize("where", ["total on the GPU", "total on the host"])
def test_ema_decay_with_total_steps_on_another_device_runs_where_decay_out_is(where):
    # NOTE [ema_decay_ devices]: a CUDA total_steps sends the call to the CUDA kernel first.
    out_dev, total_dev = ("cpu", "cuda") if where == "total on the GPU" else ("cuda", "cpu")
    out = torch.zeros((), device=out_dev)
    _ops.ema_decay_(out, torch.tensor(37.0, device=out_dev), torch.tensor(400.0, device=total_dev), "exp", 0.9998,
                    15.0, True, 2.0, 0.75)
    ref = torch.zeros(())
    _ops.ema_decay_(ref, torch.tensor(37.0), torch.tensor(400.0), "exp", 0.9998, 15.0, True, 2.0, 0.75)
    assert out.device.type == out_dev and torch.allclose(out.cpu(), ref, rtol=1e-6, atol=0)


def test_ema_decay_bad_input():
    out, step = torch.zeros(()), torch.zeros(())
    with pytest.raises(ValueError, match="decay_type 'exp' needs total_steps"):
        _ops.ema_decay_(out, step, None, "exp", 0.99, 15.0, False, 1.0, 0.5)
    with pytest.raises(ValueError, match="decay_type must be one of 'constant', 'threshold', 'exp', got 'cosine'"):
        _ops.ema_decay_(out, step, None, "cosine", 0.99, 15.0, False, 1.0, 0.5)
    with pytest.raises(ValueError, match="step must be a float32 tensor with one element"):
        _ops.ema_decay_(out, torch.zeros(2), None, "constant", 0.99, 15.0, False, 1.0, 0.5)
    # Each schedule setting names itself; NaN and the infinities are in no range (nothing written).
    for i, name in ((5, "beta"), (7, "warmup_gamma"), (8, "warmup_power")):
        for bad in (float("nan"), float("inf"), 0.0):
            args = [out, step, None, "threshold", 0.99, 15.0, True, 1.0, 0.5]
            args[i] = bad
            with pytest.raises(ValueError, match=rf"{name} must be a finite number > 0, got {bad:g}"):
                _ops.ema_decay_(*args)
    assert out.item() == 0.0


# ---- ema_step_ ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [None, 0.0, 1.0])
def test_ema_step_averages_copies_and_counts(device, flag):
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
    shapes = [(7,), (3, 5), (4,), (1031,)]
    ema = [rand(s, dt, device) for s, dt in zip(shapes, dtypes)]
    src = [rand(s, dt, device) for s, dt in zip(shapes, dtypes)]
    # Same-shaped integer counters (one select for all) and a lone one.
    copy_dst = [torch.randint(0, 9, (), device=device) for _ in range(3)] + [torch.randint(0, 9, (2, 2), device=device)]
    copy_src = [torch.randint(10, 19, t.shape, device=device) for t in copy_dst]
    decay, step = torch.tensor(0.9, device=device), torch.tensor(5.0, device=device)
    e0, c0 = [t.clone() for t in ema], [t.clone() for t in copy_dst]
    found = None if flag is None else torch.tensor(flag, device=device)
    _ops.ema_step_(ema, src, copy_dst, copy_src, decay, step, found)
    if flag == 1.0:
        assert all(torch.equal(a, b) for a, b in zip(ema, e0)) and all(torch.equal(a, b) for a, b in zip(copy_dst, c0))
        assert step.item() == 5.0
        return
    w = 1.0 - decay.double()  # the float32 decay, as the op reads it
    for e, before, s in zip(ema, e0, src):
        expected = (before.double() + w * (s.double() - before.double())).to(e.dtype)
        tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(e.dtype, 1e-2)
        torch.testing.assert_close(e, expected, rtol=tol, atol=tol)
    assert all(torch.equal(a, b) for a, b in zip(copy_dst, copy_src))
    assert step.item() == 6.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [None, 0.0, 1.0])
def test_ema_step_copies_mixed_buffers_exactly(device, flag):
    # BatchNorm-like buffers of many shapes and dtypes, non-finite values on both
    # sides, a non-contiguous destination and a source of another dtype: a
    # skipped step keeps every destination bit for bit, else each gets its source.
    g = torch.Generator().manual_seed(0)
    shapes = [(), (3,), (32,), (64,), (1024,), (5, 7), (2, 3, 4)]
    dst, src = [], []
    for dt in (torch.float32, torch.int64, torch.bfloat16):
        for shape in shapes:
            d = (torch.randn(shape, generator=g) * 100).to(dt)
            dst.append(d.to(device))
            src.append((torch.randn(shape, generator=g) * 100).to(dt).to(device))
    dst[4].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    src[3].view(-1)[:2] = torch.tensor([float("-inf"), float("nan")])
    dst.append(torch.randn(6, 4, generator=g).to(device).t())  # non-contiguous
    src.append(torch.randn(4, 6, generator=g, dtype=torch.float64).to(device))
    before = [d.clone() for d in dst]
    step = torch.tensor(2.0, device=device)
    found = None if flag is None else torch.tensor(flag, device=device)
    _ops.ema_step_([], [], dst, src, torch.tensor(0.9, device=device), step, found)
    expected = before if flag == 1.0 else [s.to(d.dtype) for s, d in zip(src, dst)]
    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    for i, (d, e) in enumerate(zip(dst, expected)):
        assert d.dtype == e.dtype and d.shape == e.shape and torch.equal(bits(d), bits(e)), i
    assert step.item() == (2.0 if flag == 1.0 else 3.0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_ema_ops(device):
    step = torch.tensor(3.0, device=device)
    torch.library.opcheck(torch.ops.fusetrain.ema_decay_,
                          (torch.zeros((), device=device), step, torch.tensor(100.0, device=device), "exp", 0.999,
                           15.0, True, 1.0, 0.75))
    ema = [torch.randn(5, device=device), torch.randn(3, device=device, dtype=torch.float64)]
    src = [torch.randn(5, device=device), torch.randn(3, device=device, dtype=torch.float64)]
    cd = [torch.zeros((), dtype=torch.long, device=device)]
    cs = [torch.ones((), dtype=torch.long, device=device)]
    torch.library.opcheck(torch.ops.fusetrain.ema_step_,
                          (ema, src, cd, cs, torch.tensor(0.9, device=device), step.clone()),
                          {"found_inf": torch.zeros((), device=device)})
    torch.library.opcheck(torch.ops.fusetrain.ema_step_,
                          ([], [], [], [], torch.tensor(0.9, device=device), step.clone()), {})


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_skip_counters(device):
    scale = torch.tensor(1024.0, device=device)
    tracker = torch.zeros((), dtype=torch.int32, device=device)
    last, total = torch.zeros((), device=device), torch.zeros((), device=device)
    for flag in [1.0, 0.0, 1.0, 1.0]:
        _ops.update_scale_(scale, tracker, torch.tensor(flag, device=device), 2.0, 0.5, 100, last, total)
        assert last.item() == flag
    assert total.item() == 3.0 and scale.item() == 128.0
    with pytest.raises(RuntimeError, match="skipped_steps must be a float32 tensor with one element"):
        _ops.update_scale_(scale, tracker, torch.zeros((), device=device), 2.0, 0.5, 100, last,
                           torch.zeros(2, device=device))
