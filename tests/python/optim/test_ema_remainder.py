"""EMA of bfloat16 weights with int16 remainders (NOTE [ema remainder] in
csrc/common/lean_state.h): the bfloat16 EMA tensor joined with its remainder
is bit for bit the float32 EMA of the same sources, in the update pass
(fused_step_), in ema_update_/ema_step_ and through ModelEMA; a bfloat16 EMA
without one stalls."""

import copy

import pytest
import torch
from torch import nn

from fusetrain import ModelEMA, TrainStep, _ops
from fusetrain.optim import SGD, AdamW, Lamb, Lion
from fusetrain.optim._state_layout import _join_remainder, _split_remainder

from _test_helpers import CUDA, DEVICES, kind_record


def joined(ema: ModelEMA) -> dict:
    """The EMA copy's values, bfloat16 tensors joined with their remainders."""
    out = {}
    for name, t in ema.module.state_dict().items():
        r = ema._remainders.get(name)
        out[name] = _join_remainder(t, r) if r is not None else t
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", [[], [1], [5, 1031, 70001], [3] * 40])
def test_ema_update_with_remainders_is_the_float32_ema(device, sizes):
    # Mixed dtypes in one call: remainders go with the bfloat16 entries only.
    emas32 = [torch.randn(n, device=device) * 3 for n in sizes]
    srcs32 = [torch.randn(n, device=device).bfloat16().float() for n in sizes]
    ema16, rems = map(list, zip(*[_split_remainder(e) for e in emas32])) if sizes else ([], [])
    extra, extra_src = torch.randn(7, device=device), torch.randn(7, device=device)
    extra_ref = extra.clone()
    decay = torch.tensor(0.9993, device=device)
    for _ in range(3):
        _ops.ema_update_(emas32 + [extra_ref], srcs32 + [extra_src], decay)
        _ops.ema_update_(ema16 + [extra], [s.bfloat16() for s in srcs32] + [extra_src], decay, remainders=rems)
    for e16, r, e32 in zip(ema16, rems, emas32):
        assert torch.equal(_join_remainder(e16, r), e32)
    assert torch.equal(extra, extra_ref)


def test_ema_update_remainder_errors():
    e, s = torch.zeros(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)
    decay = torch.tensor(0.9)
    with pytest.raises(RuntimeError, match="one int16 tensor per bfloat16 ema tensor"):
        _ops.ema_update_([e, e.clone()], [s, s], decay, remainders=[torch.zeros(4, dtype=torch.int16)])
    with pytest.raises(RuntimeError, match="must be an int16 tensor"):
        _ops.ema_update_([e], [s], decay, remainders=[torch.zeros(4, dtype=torch.int32)])
    with pytest.raises(RuntimeError, match="must be an int16 tensor"):
        _ops.ema_update_([e], [s], decay, remainders=[torch.zeros(5, dtype=torch.int16)])
    assert torch.equal(e, torch.zeros(4, dtype=torch.bfloat16))


def _pair(device, numel=4100):
    """A bfloat16 param list and its float32 twin (the same values)."""
    torch.manual_seed(0)
    shapes = [(numel,), (7, 3), (1,)]
    p16 = [nn.Parameter(torch.randn(s, device=device).bfloat16()) for s in shapes]
    p32 = [nn.Parameter(p.detach().float()) for p in p16]
    return p16, p32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_cls,kw", [(AdamW, dict(weight_decay=0.1)), (SGD, dict(momentum=0.9)), (Lion, {})])
@pytest.mark.parametrize("master", [True, "remainder"])
@pytest.mark.parametrize("state_dtype", [torch.float32, "int8"])
def test_update_pass_ema_with_remainders_is_the_float32_runs(device, opt_cls, kw, master, state_dtype):
    # A bfloat16 run with masters is the float32 run (same masters), so its
    # EMA (which follows the masters) joined with the remainders is the
    # float32 run's EMA, bit for bit; the int8 state's stream is the same too.
    if state_dtype == "int8":  # the 4100-element param takes int8 moments (the small-tensor rule)
        kw = dict(kw, state_dtype="int8")
    p16, p32 = _pair(device)
    o16 = opt_cls(p16, lr=1e-2, master_weights=master, max_grad_norm=1.0, **kw)
    o32 = opt_cls(p32, lr=1e-2, max_grad_norm=1.0, **kw)
    e16 = [p.detach().clone() for p in p16]
    r16 = [torch.zeros_like(p, dtype=torch.int16) for p in p16]
    e32 = [p.detach().clone() for p in p32]
    decay = torch.tensor(0.999, device=device)
    o16.attach_ema(dict(zip(p16, e16)), decay, dict(zip(p16, r16)))
    o32.attach_ema(dict(zip(p32, e32)), decay)
    for _ in range(4):
        grads = [torch.randn_like(p32[i]).bfloat16() for i in range(len(p32))]
        for p, g in zip(p16, grads):
            p.grad = g
        for p, g in zip(p32, grads):
            p.grad = g.float()
        o16.step()
        o32.step()
    for a, r, b in zip(e16, r16, e32):
        assert torch.equal(_join_remainder(a, r), b)
    assert any(r.abs().sum() > 0 for r in r16)


def test_update_pass_ema_stochastic_params_follows_the_stored_weights():
    # Without a master the EMA follows the stored (stochastically rounded)
    # param: the joined EMA is the float32 EMA of those values.
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(300).bfloat16())
    opt = AdamW([p], lr=1e-3, master_weights="stochastic")
    e, r = p.detach().clone(), torch.zeros(300, dtype=torch.int16)
    ref = p.detach().float().clone()
    decay = torch.tensor(0.99)
    opt.attach_ema({p: e}, decay, {p: r})
    w = torch.tensor(1.0) - decay
    for _ in range(5):
        p.grad = torch.randn(300).bfloat16()
        opt.step()
        ref = ref + w * (p.detach().float() - ref)
    torch.testing.assert_close(_join_remainder(e, r), ref, rtol=2e-7, atol=1e-8)


def test_attach_ema_remainder_errors():
    p16, _ = _pair("cpu")
    opt = AdamW(p16, lr=1e-2)
    emas = {p: p.detach().clone() for p in p16}
    decay = torch.tensor(0.9)
    with pytest.raises(ValueError, match="needs an EMA remainder"):
        opt.attach_ema(emas, decay, {p16[0]: torch.zeros_like(p16[0], dtype=torch.int16)})
    with pytest.raises(ValueError, match="must be an int16 tensor"):
        opt.attach_ema(emas, decay, {p: torch.zeros_like(p, dtype=torch.int32) for p in p16})
    lamb = Lamb(p16, lr=1e-2)
    with pytest.raises(ValueError, match="element-wise optimizers"):
        lamb.attach_ema(emas, decay, {p: torch.zeros_like(p, dtype=torch.int16) for p in p16})


def _bn_model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4)).to(dtype)


def test_model_ema_update_with_remainders_is_the_float32_ema():
    m16 = _bn_model()
    m32 = copy.deepcopy(m16).float()
    a = ModelEMA(m16, decay=0.9995, decay_type="constant")
    b = ModelEMA(m32, decay=0.9995, decay_type="constant")
    assert a.remainder and not b.remainder
    for _ in range(6):
        with torch.no_grad():
            for p in m16.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            m16(torch.randn(32, 8).bfloat16())  # moves the bfloat16 running stats
        m32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in m16.state_dict().items()})
        a.update(m16)
        b.update(m32)
    ja, sb = joined(a), b.module.state_dict()
    for k, v in sb.items():
        assert torch.equal(ja[k], v), k
    # Without remainders the bfloat16 EMA hardly moves (updates round away);
    # with them every element does.
    m = _bn_model()
    c = ModelEMA(m, decay=0.9995, decay_type="constant", remainder=False)
    d = ModelEMA(m, decay=0.9995, decay_type="constant")
    assert not c.remainder and d.remainder
    start = copy.deepcopy(c.module.state_dict())
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05)
    for _ in range(5):
        c.update(m)
        d.update(m)
    moved_c = [(v != start[k]).float().mean() for k, v in c.module.state_dict().items() if "weight" in k]
    moved_d = [(v != start[k].float()).float().mean() for k, v in joined(d).items() if "weight" in k]
    assert max(moved_c) < 0.2 and min(moved_d) == 1.0


@pytest.mark.parametrize("opt_name", ["adamw", "lamb"])
def test_model_ema_attached_with_remainders(opt_name):
    # AdamW carries the remainders in its update pass: the float32 run's EMA
    # bit for bit. Lamb cannot: the EMA averages its params after the step,
    # as ema.update(model) would.
    m16 = _bn_model()
    m32 = copy.deepcopy(m16).float()
    if opt_name == "adamw":
        o16 = AdamW(m16.parameters(), lr=1e-2, master_weights="remainder")
        o32 = AdamW(m32.parameters(), lr=1e-2)
        b = ModelEMA(m32, decay=0.999, decay_type="constant", include_buffers=False).attach(o32)
    else:
        o16 = Lamb(m16.parameters(), lr=1e-2, master_weights=True)
        m_ref = copy.deepcopy(m16)
        o_ref = Lamb(m_ref.parameters(), lr=1e-2, master_weights=True)
        b = ModelEMA(m_ref, decay=0.999, decay_type="constant", include_buffers=False)
    a = ModelEMA(m16, decay=0.999, decay_type="constant", include_buffers=False).attach(o16)
    other = m32 if opt_name == "adamw" else m_ref
    o_other = o32 if opt_name == "adamw" else o_ref
    for _ in range(4):
        x = torch.randn(16, 8)
        for model, opt, dt in ((m16, o16, torch.bfloat16), (other, o_other, next(other.parameters()).dtype)):
            opt.zero_grad()
            model(x.to(dt)).float().square().mean().backward()
        for p16, po in zip(m16.parameters(), other.parameters()):
            po.grad = p16.grad.to(po.dtype)
        o16.step()
        o_other.step()
        if opt_name == "lamb":
            b.update(m_ref)
    ja = joined(a)
    for k, v in joined(b).items():
        if v.is_floating_point() and "running" not in k:
            assert torch.equal(ja[k], v), k


def test_model_ema_state_dict_keeps_remainders():
    m = _bn_model()
    a = ModelEMA(m, decay=0.9, decay_type="constant")
    for _ in range(3):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        a.update(m)
    sd = a.state_dict()
    assert sd["remainders"] and all(r.dtype == torch.int16 for r in sd["remainders"].values())
    b = ModelEMA(_bn_model(), decay=0.5)
    b.load_state_dict(sd)
    for k, v in joined(a).items():
        assert torch.equal(joined(b)[k], v)
    # A state saved without remainders: the bfloat16 values are the EMA.
    old = dict(sd)
    del old["remainders"]
    b.load_state_dict(old)
    assert all(int(r.abs().sum()) == 0 for r in b._remainders.values())
    b.update(m)
    b.reset_remainders()
    assert all(int(r.abs().sum()) == 0 for r in b._remainders.values())
    with pytest.raises(ValueError, match="remainder must be True, False or None"):
        ModelEMA(m, remainder="yes")


def _step_args(kind="adam", **fields):
    """fused_step_ over one bfloat16 param with an EMA (a group record with has_ema)."""
    p = torch.randn(37).bfloat16()
    record = kind_record(kind, ema=True, **fields)
    return (kind, [p], [torch.randn(37).bfloat16()], [torch.zeros(())], [torch.zeros(37)], [torch.zeros(37)], [], [],
            [p.clone()], [1], [torch.tensor(0.1)], record), p


ADAM = dict(betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8)


def test_fused_step_refuses_remainders_that_do_not_fit():
    args, p = _step_args(**ADAM)
    before = p.clone()
    decay = torch.tensor(0.9)
    with pytest.raises(ValueError, match="ema_remainders has 2 tensors but the bfloat16 EMA tensors need 1"):
        torch.ops.fusetrain.fused_step_(*args, ema_decay=decay, ema_remainders=[torch.zeros(37, dtype=torch.int16)] * 2)
    with pytest.raises(RuntimeError, match="must be an int16 tensor with the EMA's shape"):
        torch.ops.fusetrain.fused_step_(*args, ema_decay=decay, ema_remainders=[torch.zeros(36, dtype=torch.int16)])
    with pytest.raises(ValueError, match="stalled_out must be an int64 tensor"):
        torch.ops.fusetrain.fused_step_(*args, ema_decay=decay, stalled_out=torch.zeros(()))
    assert torch.equal(p, before)
    lamb, _ = _step_args("lamb", betas=(0.9, 0.99), weight_decay=0.0, eps=1e-6)
    with pytest.raises(ValueError, match="EMA remainders are for the element-wise optimizers"):
        torch.ops.fusetrain.fused_step_(*lamb, ema_decay=decay, ema_remainders=[torch.zeros(37, dtype=torch.int16)])
    with pytest.raises(ValueError, match="does not count stalled updates"):
        torch.ops.fusetrain.fused_step_(*lamb, ema_decay=decay, stalled_out=torch.zeros((), dtype=torch.int64))


def test_opcheck_ema_remainders_and_stalled_out():
    args, _ = _step_args(**ADAM)
    torch.library.opcheck(torch.ops.fusetrain.fused_step_.default, args,
                          {"ema_decay": torch.tensor(0.9), "ema_remainders": [torch.zeros(37, dtype=torch.int16)],
                           "stalled_out": torch.zeros((), dtype=torch.int64)})
    ema = [torch.randn(5, 3).bfloat16(), torch.randn(4)]
    src = [torch.randn(5, 3).bfloat16(), torch.randn(4)]
    rems = [torch.zeros(5, 3, dtype=torch.int16)]
    torch.library.opcheck(torch.ops.fusetrain.ema_update_.default, (ema, src, torch.tensor(0.9)),
                          {"remainders": rems})
    torch.library.opcheck(torch.ops.fusetrain.ema_step_.default,
                          (ema, src, [torch.zeros(2)], [torch.ones(2)], torch.tensor(0.9), torch.zeros(())),
                          {"remainders": rems})


def test_compiled_step_carries_the_remainders():
    # The attached EMA with remainders in a full-graph compiled step: the eager step's bits.
    runs = []
    for compiled in (False, True):
        p16, _ = _pair("cpu", 300)
        opt = AdamW(p16, lr=1e-2, master_weights="remainder")
        e, r = [p.detach().clone() for p in p16], [torch.zeros_like(p, dtype=torch.int16) for p in p16]
        opt.attach_ema(dict(zip(p16, e)), torch.tensor(0.99), dict(zip(p16, r)))
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        torch.manual_seed(3)
        for _ in range(3):
            for p in p16:
                p.grad = torch.randn_like(p)
            step()
        runs.append([_join_remainder(a, b) for a, b in zip(e, r)])
    torch._dynamo.reset()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["compile", pytest.param("cuda_graph", marks=CUDA)])
def test_train_step_carries_ema_remainders_and_stall_counts(mode):
    # A bfloat16 model with stochastic rounding, int8 moments, a ModelEMA (remainders) and the stall counter,
    # compiled (aot_eager) or captured as one CUDA graph: the eager step's weights, EMA and count.
    device = "cuda" if mode == "cuda_graph" else "cpu"

    def run(m):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 4)).to(device, torch.bfloat16)
        opt = AdamW(model.parameters(), lr=torch.tensor(1e-3, device=device), master_weights="stochastic",
                    state_dtype="int8")
        counter = opt.track_stalled_updates()
        ema = ModelEMA(model, decay=0.99, decay_type="constant")
        options = {"compile_options": {"backend": "aot_eager"}} if m == "compile" else {}
        step = TrainStep(model, nn.MSELoss(), opt, mode=m, ema=ema, **options)
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            x, y = torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)
            step(x.to(device, torch.bfloat16), y.to(device, torch.bfloat16))
        return [p.detach().cpu() for p in model.parameters()], {k: v.cpu() for k, v in joined(ema).items()}, \
            int(counter)

    torch._dynamo.reset()
    try:
        eager, other = run("off"), run(mode)
    finally:
        torch._dynamo.reset()
    for a, b in zip(eager[0], other[0]):
        assert torch.equal(a, b)
    for k, v in eager[1].items():
        assert torch.equal(v, other[1][k]), k
    assert eager[2] == other[2] > 0


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("attached", [False, True])
def test_sharded_model_ema_keeps_sharded_remainders(gloo_group, attached):
    # Built before fully_shard, as the Trainer builds it: after rebuild_index
    # each bfloat16 param's remainder is a DTensor sharded like it, and the
    # sharded EMA (updated by ema.update or in the update pass) is bit for bit
    # the unsharded one.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    models, emas, opts = [], [], []
    for sharded in (False, True):
        m = _bn_model()
        ema = ModelEMA(m, decay=0.999, decay_type="constant")
        if sharded:
            fully_shard(m)
            fully_shard(ema.module)
            ema.rebuild_index()
        opt = AdamW(m.parameters(), lr=1e-2, master_weights="remainder")
        if attached:
            ema.attach(opt)
        models.append(m)
        emas.append(ema)
        opts.append(opt)
    rems = emas[1].remainder_tensors()
    assert set(rems) == set(emas[0].remainder_tensors())
    for name, p in emas[1].module.named_parameters():
        assert isinstance(p, DTensor) and isinstance(rems[name], DTensor), name
        assert rems[name].placements == p.placements and rems[name].dtype == torch.int16
    for _ in range(4):
        grads = [torch.randn_like(_full(p)) for p in models[0].parameters()]
        for m, opt, ema in zip(models, opts, emas):
            for p, g in zip(m.parameters(), grads):
                p.grad = g if not isinstance(p, DTensor) else DTensor.from_local(g, p.device_mesh, p.placements)
            opt.step()
            if not attached:
                ema.update(m)
    assert any(int(r.abs().sum()) != 0 for r in emas[0].remainder_tensors().values())
    for name, r in emas[0].remainder_tensors().items():
        assert torch.equal(_full(rems[name]), r), name
    plain = emas[0].module.state_dict()
    for k, v in emas[1].module.state_dict().items():
        assert torch.equal(_full(v), plain[k]), k
    for ema in emas:
        ema.detach()
