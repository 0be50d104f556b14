"""fusetrain.optim as a drop-in for torch.optim where a training script
changes things between steps: weights written into the model (master
weights re-synced), momentum turned on mid-run, module conversions that swap
tensors, memory-layout and dtype changes, named and tuple params, Muon's
state dict. Each case runs against torch.optim (timm for its optimizers)."""

import copy

import pytest
import torch
from torch import nn

import fusetrain  # noqa: F401
from fusetrain import ModelEMA
from fusetrain import optim as fo
from fusetrain.training.checkpoint.components import ModelState, OptimizerState
timm_optim = pytest.importorskip("timm.optim")

LR = 2.0**-6  # exact in the float32 device lr
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def net(seed=0, bias=True, conv=True):
    torch.manual_seed(seed)
    if conv:
        return nn.Sequential(nn.Conv2d(3, 4, 3, bias=bias), nn.Flatten(), nn.Linear(64, 5, bias=bias))
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 5, bias=bias))


def batch(i, conv=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(500 + i)
    x = torch.randn((8, 3, 6, 6) if conv else (8, 6), generator=g)
    y = torch.randn(8, 5, generator=g)
    return x.to(dtype), y.to(dtype)


def train(pairs, n, start=0, conv=True):
    """n steps of each (model, optimizer) pair on the same batches."""
    for i in range(n):
        for model, opt in pairs:
            p0 = next(model.parameters())
            x, y = batch(start + i, conv, p0.dtype)
            if p0.dim() == 4 and p0.is_contiguous(memory_format=torch.channels_last):
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def assert_models_close(ours, ref, **tol):
    for (n, q), p in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(q.detach().to(p.dtype), p.detach(), **(tol or TOL), msg=lambda m: f"{n}: {m}")


# ---- master weights re-synced from a param written outside the optimizer ----------------------------------


def bf16_pair(seed=3):
    """A float32 Linear holding bf16 values (the reference) and its bf16 twin (master weights)."""
    ref = nn.Linear(5, 6)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape).bfloat16().float())
    return ref, copy.deepcopy(ref).bfloat16()


def step_bf16(ref, ours, ref_opt, ours_opt, n, start):
    for i in range(n):
        g = torch.Generator().manual_seed(700 + start + i)
        for p, q in zip(ref.parameters(), ours.parameters()):
            gr = torch.randn(p.shape, generator=g).bfloat16()
            p.grad, q.grad = gr.float(), gr
        ref_opt.step()
        ours_opt.step()


def step_alone(model, opt, n, start):
    for i in range(n):
        g = torch.Generator().manual_seed(700 + start + i)
        for q in model.parameters():
            q.grad = torch.randn(q.shape, generator=g).to(q.dtype)
        opt.step()


def assert_masters_follow(ref, ours, ours_opt):
    for p, q in zip(ref.parameters(), ours.parameters()):
        master = ours_opt.state[q]["master_param"]
        torch.testing.assert_close(master, p.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(q.detach(), master.bfloat16())


def write_weights(how, model, new):
    """Write ``new`` (a state dict) into ``model`` the way a training script does."""
    if how in ("load_state_dict", "swap"):
        model.load_state_dict(new)
    elif how == "copy_":
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(new[k])
    elif how == "data":
        for k, p in model.named_parameters():
            p.data = new[k].clone()
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("keep_lists", [True, False], ids=["plan", "collect"])
@pytest.mark.parametrize("how", ["load_state_dict", "copy_", "data", "swap"])
def test_master_weights_follow_weights_written_into_the_model(how, keep_lists, request):
    if how == "swap":
        request.getfixturevalue("swap_on_conversion")
    ref, ours = bf16_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    ours_opt = fo.AdamW(ours.parameters(), lr=LR, weight_decay=0.1, master_weights=True)
    ours_opt._keep_lists = keep_lists
    step_bf16(ref, ours, ref_opt, ours_opt, 3, 0)
    torch.manual_seed(11)
    new = {k: torch.randn(v.shape).bfloat16() for k, v in ours.state_dict().items()}
    ref.load_state_dict({k: v.float() for k, v in new.items()})
    write_weights(how, ours, new)
    step_bf16(ref, ours, ref_opt, ours_opt, 3, 10)
    assert_masters_follow(ref, ours, ours_opt)


@pytest.mark.parametrize("keep_lists", [True, False], ids=["plan", "collect"])
def test_master_weights_follow_ema_weights_copied_into_the_model(keep_lists):
    # The EMA rides in the fused pass (ModelEMA.attach); its weights are then copied into the model.
    ref, ours = bf16_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    ours_opt = fo.AdamW(ours.parameters(), lr=LR, master_weights=True)
    ours_opt._keep_lists = keep_lists
    ema = ModelEMA(ours, decay=0.5, decay_type="constant").attach(ours_opt)
    step_bf16(ref, ours, ref_opt, ours_opt, 4, 0)
    averaged = {k: v.clone() for k, v in ema.module.state_dict().items()}
    assert any(not torch.equal(averaged[k], v) for k, v in ours.state_dict().items())
    ours.load_state_dict(averaged)
    ref.load_state_dict({k: v.float() for k, v in averaged.items()})
    step_bf16(ref, ours, ref_opt, ours_opt, 3, 10)
    assert_masters_follow(ref, ours, ours_opt)


def test_compiled_step_re_syncs_master_weights_when_rebuilt(fresh_dynamo):
    """torch.compile reads the write marks when it traces the step (NOTE [master re-sync]): rebuilt after the
    weights are written, the compiled step follows them, with no graph break."""
    ref, ours = bf16_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    ours_opt = fo.AdamW(ours.parameters(), lr=LR, master_weights=True)

    def step():
        ours_opt.step()

    class Compiled:
        def step(self):
            compiled()

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    step_bf16(ref, ours, ref_opt, Compiled(), 3, 0)
    torch.manual_seed(11)
    new = {k: torch.randn(v.shape).bfloat16() for k, v in ours.state_dict().items()}
    ref.load_state_dict({k: v.float() for k, v in new.items()})
    ours.load_state_dict(new)
    torch._dynamo.reset()  # what TrainStep.invalidate() does for its own compiled step
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    step_bf16(ref, ours, ref_opt, Compiled(), 3, 10)
    assert_masters_follow(ref, ours, ours_opt)


def test_train_step_compiled_follows_weights_written_between_calls(fresh_dynamo):
    """fusetrain.TrainStep checks the write marks before each compiled call (NOTE [master re-sync]): a
    load_state_dict between calls needs no invalidate(). The CompileCounter backend runs the traced graphs as
    they are, so the compiled run equals the eager one bit for bit."""
    from torch._dynamo.testing import CompileCounter

    from fusetrain import TrainStep

    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).bfloat16()
        opt = fo.AdamW(model.parameters(), lr=torch.tensor(LR), master_weights=True)
        step = TrainStep(model, nn.MSELoss(), opt, mode=mode,
                         compile_options={"backend": CompileCounter()} if mode == "compile" else None)
        g = torch.Generator().manual_seed(4)
        for i in range(6):
            if i == 3:
                torch.manual_seed(11)
                model.load_state_dict({k: torch.randn(v.shape).bfloat16() for k, v in model.state_dict().items()})
            step(torch.randn(4, 6, generator=g).bfloat16(), torch.randn(4, 3, generator=g).bfloat16())
        return model, opt

    (eager, eager_opt), (comp, comp_opt) = run("off"), run("compile")
    for p, q in zip(eager.parameters(), comp.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(eager_opt.state[p]["master_param"], comp_opt.state[q]["master_param"])


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_resume_into_live_objects_keeps_the_loaded_master_whole(optimizer_first):
    """The Trainer's resume (model and optimizer state loaded into built objects): the loaded master is in
    step with the loaded weights, so training goes on bit-identically to a run without the round trip, in
    either load order."""
    _, model = bf16_pair()
    opt = fo.AdamW(model.parameters(), lr=LR, master_weights=True)
    step_alone(model, opt, 3, 0)
    ck = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    twin = copy.deepcopy(model)
    twin_opt = fo.AdamW(twin.parameters(), lr=LR, master_weights=True)
    twin_opt.load_state_dict(copy.deepcopy(ck["optimizer"]))
    step_alone(model, opt, 4, 20)  # moves away from the checkpoint
    if optimizer_first:
        opt.load_state_dict(ck["optimizer"])
        model.load_state_dict(ck["model"])
    else:
        ModelState(model).load_state_dict(ck["model"])  # the Trainer's resume: weights, then optimizer state
        OptimizerState(opt).load_state_dict(ck["optimizer"])
    step_alone(model, opt, 3, 40)
    step_alone(twin, twin_opt, 3, 40)
    for q, t in zip(model.parameters(), twin.parameters()):
        assert torch.equal(q, t)
        assert torch.equal(opt.state[q]["master_param"], twin_opt.state[t]["master_param"])


# ---- SGD: a momentum buffer starts at the gradient ---------------------------------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_turned_on_mid_run_starts_at_the_gradient(nesterov):
    ref = net(conv=False)
    ours = copy.deepcopy(ref)
    kw = dict(lr=0.05, momentum=0.0, dampening=0.0 if nesterov else 0.5, weight_decay=0.01)
    theirs, mine = torch.optim.SGD(ref.parameters(), **kw), fo.SGD(ours.parameters(), **kw)
    train([(ref, theirs), (ours, mine)], 3, conv=False)
    for opt in (theirs, mine):
        opt.param_groups[0].update(momentum=0.9, nesterov=nesterov)
    train([(ref, theirs), (ours, mine)], 4, start=10, conv=False)
    assert_models_close(ours, ref)
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(mine.state[q]["momentum_buffer"], theirs.state[p]["momentum_buffer"], **TOL)


@pytest.mark.parametrize("source", ["torch", "fusetrain"])
def test_sgd_resuming_a_momentum_free_checkpoint_with_momentum(source):
    ref = net(conv=False)
    first = (torch.optim.SGD if source == "torch" else fo.SGD)(ref.parameters(), lr=0.05)
    train([(ref, first)], 3, conv=False)
    ours = copy.deepcopy(ref)
    kw = dict(lr=0.05, momentum=0.9, dampening=0.3)
    theirs, mine = torch.optim.SGD(ref.parameters(), **kw), fo.SGD(ours.parameters(), **kw)
    sd = first.state_dict()
    theirs.load_state_dict(sd)
    mine.load_state_dict(sd)
    for g in (theirs.param_groups[0], mine.param_groups[0]):
        g.update(momentum=0.9, dampening=0.3)
    train([(ref, theirs), (ours, mine)], 4, start=10, conv=False)
    assert_models_close(ours, ref)


# ---- torch.utils.swap_tensors after steps: the kept step plan does not pin params --------------------------

# (fusetrain optimizer, reference, kwargs for both): torch.optim, or timm where torch has none.
SWAP_CASES = {
    "Adam": (fo.Adam, torch.optim.Adam, dict(lr=LR, weight_decay=0.01)),
    "AdamW": (fo.AdamW, torch.optim.AdamW, dict(lr=LR)),
    "SGD": (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "RMSprop": (fo.RMSprop, torch.optim.RMSprop, dict(lr=LR, momentum=0.5)),
    "Adadelta": (fo.Adadelta, torch.optim.Adadelta, dict(lr=1.0)),
    "RAdam": (fo.RAdam, torch.optim.RAdam, dict(lr=LR)),
    "NAdam": (fo.NAdam, torch.optim.NAdam, dict(lr=LR)),
    "Muon": (fo.Muon, torch.optim.Muon, dict(lr=LR)),
    "Lion": (fo.Lion, timm_optim.Lion, dict(lr=2.0**-10)),
    "Lamb": (fo.Lamb, timm_optim.Lamb, dict(lr=LR)),
    "AdamP": (fo.AdamP, timm_optim.AdamP, dict(lr=LR)),
    "RMSpropTF": (fo.RMSpropTF, timm_optim.RMSpropTF, dict(lr=LR)),
}
# Muon's Newton-Schulz iterations run in bfloat16 (test_muon.py).
SWAP_TOL = {"Muon": dict(rtol=0, atol=2e-5)}


@pytest.mark.parametrize("name", list(SWAP_CASES))
def test_swap_tensors_conversions_after_steps(name, swap_on_conversion):
    ours_cls, ref_cls, kw = SWAP_CASES[name]
    muon = name == "Muon"  # torch.optim.Muon takes matrices only
    ref = net(bias=not muon, conv=False)
    ours = copy.deepcopy(ref)
    theirs, mine = ref_cls(ref.parameters(), **kw), ours_cls(ours.parameters(), **kw)
    train([(ref, theirs), (ours, mine)], 3, conv=False)
    before = [id(p) for p in ours.parameters()]
    torch.manual_seed(4)
    new = {k: torch.randn(v.shape) for k, v in ref.state_dict().items()}
    for model in (ref, ours):
        model.load_state_dict(new)  # swaps every param's tensor
        model.float()  # and again (a conversion that keeps the dtype)
    assert [id(p) for p in ours.parameters()] == before
    train([(ref, theirs), (ours, mine)], 3, start=10, conv=False)
    assert_models_close(ours, ref, **SWAP_TOL.get(name, TOL))


@pytest.mark.parametrize("name", ["SGD", "Adadelta"])
@pytest.mark.parametrize("swap", [False, True], ids=["data", "swap"])
def test_to_float64_after_steps_matches_torch(name, swap):
    ours_cls, ref_cls, kw = SWAP_CASES[name]
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        ref = net(conv=False)
        ours = copy.deepcopy(ref)
        theirs, mine = ref_cls(ref.parameters(), foreach=False, **kw), ours_cls(ours.parameters(), **kw)
        train([(ref, theirs), (ours, mine)], 3, conv=False)
        ref.to(torch.float64)
        ours.to(torch.float64)
        train([(ref, theirs), (ours, mine)], 3, start=10, conv=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    assert_models_close(ours, ref)


# ---- memory layout: state follows its param's layout --------------------------------------------------------

LAYOUT_CASES = ["SGD", "AdamW", "RMSprop"]


@pytest.mark.parametrize("keep_lists", [True, False], ids=["plan", "collect"])
@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_channels_last_after_steps_matches_torch(name, keep_lists):
    ours_cls, ref_cls, kw = SWAP_CASES[name]
    ref = net()
    ours = copy.deepcopy(ref)
    theirs, mine = ref_cls(ref.parameters(), foreach=False, **kw), ours_cls(ours.parameters(), **kw)
    mine._keep_lists = keep_lists
    train([(ref, theirs), (ours, mine)], 2)
    for model in (ref, ours):
        model.to(memory_format=torch.channels_last)
    train([(ref, theirs), (ours, mine)], 3, start=10)
    assert_models_close(ours, ref)
    conv_weight = ours[0].weight
    assert conv_weight.is_contiguous(memory_format=torch.channels_last)
    for k, v in mine.state[conv_weight].items():
        if v.dim() == 4:
            assert v.stride() == conv_weight.stride(), k

def test_attached_ema_follows_a_channels_last_model():
    """model.to(memory_format=torch.channels_last) after steps with an attached ModelEMA: the EMA copy is
    re-laid out like its param (NOTE [state layout]); its values follow a run that stays contiguous (up to the
    rounding of the channels_last convolution's gradients)."""
    runs = []
    for to_cl in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
        opt = fo.AdamW(m.parameters(), lr=1e-2)
        ema = ModelEMA(m, decay=0.9, decay_type="constant").attach(opt)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        for i in range(4):
            if i == 2 and to_cl:
                m.to(memory_format=torch.channels_last)
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append((m, ema.module))
    (m0, e0), (m1, e1) = runs
    for a, b in zip(list(m0.parameters()) + list(e0.parameters()), list(m1.parameters()) + list(e1.parameters())):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in e1.parameters() if p.dim() == 4)



@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_state_loads_across_layouts(name):
    ours_cls, ref_cls, kw = SWAP_CASES[name]
    src = net()
    src_opt = ref_cls(src.parameters(), foreach=False, **kw)
    train([(src, src_opt)], 2)
    ref = copy.deepcopy(src).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(ref)
    theirs, mine = ref_cls(ref.parameters(), foreach=False, **kw), ours_cls(ours.parameters(), **kw)
    theirs.load_state_dict(src_opt.state_dict())
    mine.load_state_dict(src_opt.state_dict())  # saved from the contiguous model
    train([(ref, theirs), (ours, mine)], 3, start=10)
    assert_models_close(ours, ref)
    # And back: a channels_last optimizer's state into a contiguous model.
    back = copy.deepcopy(src)
    back_opt = ours_cls(back.parameters(), **kw)
    back_opt.load_state_dict(mine.state_dict())
    train([(back, back_opt)], 1)


def test_column_major_param_data_and_bf16_master_follow_the_layout():
    ref = nn.Linear(7, 5)
    ours = copy.deepcopy(ref)
    theirs = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    mine = fo.AdamW(ours.parameters(), lr=LR)
    for model, opt in ((ref, theirs), (ours, mine)):
        for i in range(2):
            g = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        model.weight.data = model.weight.data.t().contiguous().t()  # column-major
        for i in range(2, 5):
            g = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    assert ours.weight.stride() == (1, 5)
    assert mine.state[ours.weight]["exp_avg"].stride() == (1, 5)
    assert_models_close(ours, ref)
    # A bf16 param with a master copy: the master follows the layout too.
    _, low = bf16_pair()
    opt = fo.AdamW(low.parameters(), lr=LR, master_weights=True)
    low.weight.grad = torch.randn(low.weight.shape).bfloat16()
    opt.step()
    low.weight.data = low.weight.data.t().contiguous().t()
    low.weight.grad = torch.randn(low.weight.shape).bfloat16()
    opt.step()
    master = opt.state[low.weight]["master_param"]
    assert master.stride() == low.weight.stride()
    assert torch.equal(master.bfloat16(), low.weight.detach())


# ---- Muon: named params, state-dict round trip, complex params ---------------------------------------------


def muon_net(seed=1):
    return net(seed, bias=False, conv=False)


def test_muon_takes_named_params_like_torch():
    ref = muon_net()
    ours = copy.deepcopy(ref)
    theirs, mine = torch.optim.Muon(ref.named_parameters(), lr=LR), fo.Muon(ours.named_parameters(), lr=LR)
    train([(ref, theirs), (ours, mine)], 4, conv=False)
    assert_models_close(ours, ref, **SWAP_TOL["Muon"])
    names = [n for n, _ in ours.named_parameters()]
    assert mine.param_groups[0]["param_names"] == theirs.param_groups[0]["param_names"] == names
    assert mine.state_dict()["param_groups"][0]["param_names"] == names
    # Named vectors go to the AdamW group with their names.
    mixed = net(conv=False)
    opt = fo.Muon(mixed.named_parameters(), lr=LR)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[1]["param_names"] == [n for n, p in mixed.named_parameters() if p.dim() < 2]


@pytest.mark.parametrize("named", [False, True])
def test_muon_state_dict_round_trips(named):
    model = net(conv=False)
    opt = fo.Muon(model.named_parameters() if named else model.parameters(), lr=LR)
    train([(model, opt)], 2, conv=False)
    sd = copy.deepcopy(opt.state_dict())
    again = fo.Muon(model.named_parameters() if named else model.parameters(), lr=LR)
    again.load_state_dict(sd)
    out = again.state_dict()
    assert out["param_groups"] == sd["param_groups"]
    assert all("differentiable" not in g for g in again.param_groups)
    assert copy.deepcopy(again).state_dict()["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        assert set(out["state"][k]) == set(st)
        for n, v in st.items():
            assert torch.equal(out["state"][k][n], v)
    # torch.optim.Muon's state dict keeps its keys too.
    ref = muon_net()
    theirs = torch.optim.Muon(ref.parameters(), lr=LR)
    train([(ref, theirs)], 1, conv=False)
    mine = fo.Muon(copy.deepcopy(ref).parameters(), lr=LR)
    mine.load_state_dict(theirs.state_dict())
    assert all("differentiable" not in g for g in mine.param_groups)
    assert set(mine.state_dict()["param_groups"][0]) - {"use_muon", "adamw_betas", "adamw_eps", "max_grad_norm",
                                                        "master_weights", "maximize"} \
        == set(theirs.state_dict()["param_groups"][0])


def test_muon_refuses_complex_params_like_torch():
    w = torch.randn(4, 3, dtype=torch.complex64, requires_grad=True)
    w.grad = torch.randn(4, 3, dtype=torch.complex64)
    theirs = torch.optim.Muon([w], lr=LR)
    with pytest.raises(RuntimeError, match="complex"):
        theirs.step()
    # Refused at the step, as torch refuses it (torch's error and words), with the way out.
    with pytest.raises(RuntimeError, match=r"Muon does not support complex parameters: param 0 .*complex64.*use_muon"):
        fo.Muon([w], lr=LR).step()
    with pytest.raises(RuntimeError, match="Muon does not support complex parameters"):
        fo.Muon([("w", w)], lr=LR).step()
    # In an AdamW group a complex param is updated as torch.optim.AdamW updates it.
    before = w.detach().clone()
    opt = fo.Muon([{"params": [w], "use_muon": False}], lr=LR)
    opt.step()
    ref = before.clone().requires_grad_()
    ref.grad = w.grad.clone()
    torch.optim.AdamW([ref], lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=False).step()
    torch.testing.assert_close(w.detach(), ref.detach(), **TOL)
    # A group switched to Muon after construction is refused before anything is applied.
    opt.param_groups[0]["use_muon"] = True
    after = w.detach().clone()
    with pytest.raises(RuntimeError, match="Muon does not support complex parameters"):
        opt.step()
    assert torch.equal(w.detach(), after)


# ---- a tuple as group["params"] --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_tuple_group_params_step_like_torch(name):
    ours_cls, ref_cls, kw = SWAP_CASES[name]
    ref = net(conv=False)
    ours = copy.deepcopy(ref)
    theirs, mine = ref_cls(ref.parameters(), foreach=False, **kw), ours_cls(ours.parameters(), **kw)
    for opt in (theirs, mine):
        opt.param_groups[0]["params"] = tuple(opt.param_groups[0]["params"])
    train([(ref, theirs), (ours, mine)], 3, conv=False)
    assert_models_close(ours, ref)
