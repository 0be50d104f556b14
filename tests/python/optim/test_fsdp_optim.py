"""fusetrain's optimizers on FSDP2-sharded models (DTensor parameters), over
2 and 4 gloo processes: training with clipping, loss scaling, master weights
for bf16 parameters and an EMA riding in the step matches the same training
in one process; the clipping norm is the unsharded one; a non-finite gradient
on one rank skips the step on every rank (NOTE [sharded steps] in
python/fusetrain/optim/_sharded.py). On a CUDA machine the same cases run
over NCCL, one process per GPU (on one GPU: a mesh of one, still DTensor
shards and the step's collective)."""

import os

import pytest
import torch
from torch import nn

import fusetrain
from fusetrain.optim import AdamW, Lamb, Muon, NAdam

from _dist_helpers import requires_gloo, run_distributed
from _test_helpers import CUDA

pytestmark = [requires_gloo, pytest.mark.dist]  # spawns processes (README, Tests)

STEPS, BATCH = 6, 8
OPTIMIZERS = {"AdamW": AdamW, "NAdam": NAdam, "Lamb": Lamb}


def make_model(dtype, device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))
    return model.to(device, dtype)


def batches(dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g).to(device, dtype),
             torch.randn(BATCH, 3, generator=g).to(device, dtype)) for _ in range(STEPS)]


def train(model, opt, scaler, cfg, rank=0, world=1):
    """The same loop for the sharded and the single-process runs; returns the per-step norms and flags."""
    ema = {p: p.detach().clone() for p in model.parameters()}
    opt.attach_ema(ema, torch.tensor(0.9, device=cfg.get("device", "cpu")))
    norms, flags = [], []
    per = BATCH // world
    for step, (x, y) in enumerate(batches(cfg["dtype"], cfg.get("device", "cpu"))):
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        (scaler.scale(loss) if scaler else loss).backward()
        if step == cfg["inf_step"]:
            # The injected inf sits on the last rank only (in the one-process run: in the same tensor).
            w = model[2].weight.grad
            if rank == world - 1:
                (w.to_local() if hasattr(w, "to_local") else w).view(-1)[0] = float("inf")
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        norms.append(float(opt.last_grad_norm))
        flags.append(float(opt.last_found_inf))
    return norms, flags, ema


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def sharded_worker(rank, world, out, cfg):
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cuda", rank) if cfg.get("device") == "cuda" else "cpu"
    cfg = dict(cfg, device=device)
    model = make_model(cfg["dtype"], device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    assert all(hasattr(p, "to_local") for p in model.parameters())
    opt = OPTIMIZERS[cfg["opt"]](model.parameters(), lr=1e-2, max_grad_norm=cfg["clip"],
                                 **lean_settings(cfg))
    scaler = fusetrain.LossScaler(init_scale=1024.0) if cfg["scaler"] else None
    norms, flags, ema = train(model, opt, scaler, cfg, rank, world)
    st = opt.state[model[0].weight]
    assert hasattr(st["exp_avg"], "to_local")  # DTensor state, sharded like the param
    local = st["exp_avg"].to_local()
    assert local.shape == model[0].weight.to_local().shape and (world == 1 or local.shape[0] < 10)
    result = {"params": [full(p).cpu() for p in model.parameters()], "ema": [full(e).cpu() for e in ema.values()],
              "norms": norms, "flags": flags}
    if cfg["dtype"] == torch.bfloat16:
        result["masters"] = [master_value(opt, p, full) for p in model.parameters()]
    if rank == 0:
        torch.save(result, out)


def single(cfg):
    model = make_model(cfg["dtype"], cfg.get("device", "cpu"))
    opt = OPTIMIZERS[cfg["opt"]](model.parameters(), lr=1e-2, max_grad_norm=cfg["clip"],
                                 **lean_settings(cfg))
    scaler = fusetrain.LossScaler(init_scale=1024.0) if cfg["scaler"] else None
    norms, flags, ema = train(model, opt, scaler, cfg)
    result = {"params": [p.detach().cpu() for p in model.parameters()], "ema": [e.cpu() for e in ema.values()],
              "norms": norms, "flags": flags}
    if cfg["dtype"] == torch.bfloat16:
        result["masters"] = [master_value(opt, p, lambda t: t.detach()) for p in model.parameters()]
    return result


def lean_settings(cfg):
    """master_weights (True for bf16 unless the case names one) and state_dtype (NOTE [lean state])."""
    return dict(master_weights=cfg.get("master", cfg["dtype"] == torch.bfloat16),
                state_dtype=cfg.get("state_dtype", torch.float32))


def master_value(opt, p, whole):
    """The full value the optimizer keeps of bf16 param ``p`` (whole tensors, on the CPU)."""
    st = opt.state[p]
    if "master_remainder" not in st:
        return whole(st["master_param"]).cpu()
    from fusetrain.optim._state_layout import _join_remainder

    rem = st["master_remainder"]
    if not hasattr(rem, "to_local"):
        return _join_remainder(p.detach().cpu(), rem.cpu())
    # Joined on each shard (gloo gathers no int16), then gathered.
    from torch.distributed.tensor import DTensor

    joined = _join_remainder(p.to_local().detach(), rem.to_local())
    return whole(DTensor.from_local(joined, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())).cpu()


CASES = {
    "adamw-fp32-clip-2": dict(opt="AdamW", dtype=torch.float32, clip=0.5, scaler=False, inf_step=-1, world=2),
    "adamw-fp32-clip-scaler-inf-4": dict(opt="AdamW", dtype=torch.float32, clip=0.5, scaler=True, inf_step=2,
                                         world=4),
    "adamw-bf16-master-clip-2": dict(opt="AdamW", dtype=torch.bfloat16, clip=1.0, scaler=False, inf_step=-1,
                                     world=2),
    "adamw-bf16-remainder-bf16state-scaler-inf-2": dict(opt="AdamW", dtype=torch.bfloat16, clip=1.0, scaler=True,
                                                        inf_step=2, world=2, master="remainder",
                                                        state_dtype=torch.bfloat16),
    "nadam-fp32-inf-2": dict(opt="NAdam", dtype=torch.float32, clip=1.0, scaler=False, inf_step=3, world=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_training_matches_one_process(tmp_path, name):
    check_sharded_training(tmp_path, CASES[name])


@CUDA
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_training_matches_one_process_cuda_nccl(tmp_path, name):
    # One process per GPU, at most the case's world size (one GPU: a mesh of one).
    world = min(CASES[name]["world"], torch.cuda.device_count())
    check_sharded_training(tmp_path, dict(CASES[name], world=world, device="cuda"), backend="nccl")


def check_sharded_training(tmp_path, cfg, backend="gloo"):
    out = str(tmp_path / "sharded.pt")
    run_distributed(sharded_worker, cfg["world"], out, cfg, backend=backend)
    got, want = torch.load(out), single(cfg)
    # The clipping norm is the unsharded one (bf16 gradients: reduced in bf16 across ranks), and a rank's inf
    # skipped the step everywhere.
    norm_tol = dict(rtol=2e-3, atol=1e-5) if cfg["dtype"] == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), **norm_tol, equal_nan=True)
    assert got["flags"] == want["flags"]
    if cfg["inf_step"] >= 0:
        assert got["flags"][cfg["inf_step"]] == 1.0 and sum(got["flags"]) == 1.0
    tol = dict(rtol=2e-2, atol=2e-2) if cfg["dtype"] == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for key in ("params", "ema") + (("masters",) if "masters" in want else ()):
        for a, b in zip(got[key], want[key]):
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{key}: {m}")


def per_tensor_worker(rank, world, cls_name):
    from torch.distributed.fsdp import fully_shard

    model = make_model(torch.float32)
    fully_shard(model)
    opt = {"Lamb": Lamb, "Muon": Muon}[cls_name](model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    with pytest.raises(NotImplementedError, match=f"{cls_name}: .*sharded"):
        opt.step()


@pytest.mark.parametrize("cls_name", ["Lamb", "Muon"])
def test_optimizers_with_per_tensor_reductions_refuse_shards(cls_name):
    # Their trust ratio / orthogonalisation needs the whole tensor: a clear error, not a shard-wise update.
    run_distributed(per_tensor_worker, 2, cls_name)


def kept_lists_worker(rank, world, out):
    import copy

    from torch.distributed.fsdp import fully_shard

    results = {}
    for keep in (True, False):
        model = make_model(torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
        if not keep:  # every step collects its lists afresh
            opt._keep_lists = False
        ema = {p: p.detach().clone() for p in model.parameters()}
        opt.attach_ema(ema, torch.tensor(0.9))
        collected = []
        collect = opt._collect_group
        opt._collect_group = lambda *args: collected.append(step) or collect(*args)
        saved = None
        for step, (x, y) in enumerate(batches(torch.float32)):
            nn.functional.mse_loss(model(x), y).backward()
            if step == 2:
                model[2].weight.grad = None  # one param without a gradient for a step
            if step == 3:
                saved = copy.deepcopy(opt.state_dict())
            if step == 4:
                opt.load_state_dict(saved)  # state replaced: lists kept from before must not be used
            if step == 5:
                opt.detach_ema()
            opt.step()
            opt.zero_grad()
        if keep:  # lists collected in Python on the first step and after each change only
            assert sorted(set(collected)) == [0, 2, 3, 4, 5], collected
        results[keep] = [full(p) for p in model.parameters()] + [full(e) for e in ema.values()]
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


def test_kept_step_lists_change_nothing():
    # NOTE [step plan]: reusing a group's lists between steps gives the same numbers as collecting them
    # every step, also when a param skips a step, the state is loaded anew and the EMA is detached.
    run_distributed(kept_lists_worker, 2, None)


def int8_worker(rank, world, out, ckpt):
    # NOTE [sharded 8-bit state]: int8 moments on FSDP2 shards, a distributed checkpoint of them and a resume.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 3))  # 8192 weights: int8 moments
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        return model, AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, state_dtype="int8", state_block_size=128)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 64, generator=g), torch.randn(8, 3, generator=g)) for _ in range(5)]

    def step(model, opt, i):
        x, y = data[i]
        nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for i in range(5):
        if i == 3:
            msd, osd = get_state_dict(model, opt)
            saved = osd["state"]["0.weight"]["exp_avg"]
            assert isinstance(saved, DTensor) and saved.dtype == torch.float32  # decoded for the checkpoint
            assert "exp_avg_scales" not in osd["state"]["0.weight"]
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
        step(model, opt, i)
    st = opt.state[model[0].weight]
    assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].dtype == torch.int8
    assert st["exp_avg"].to_local().shape == (64, 64) and st["exp_avg_scales"].shape == (32,)
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32  # the small-tensor rule
    resumed, ropt = build()
    ropt.init_state()
    msd, osd = get_state_dict(resumed, ropt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(resumed, ropt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for i in (3, 4):
        step(resumed, ropt, i)
    result = {"params": [full(p).cpu() for p in model.parameters()],
              "resumed": [full(p).cpu() for p in resumed.parameters()]}
    if rank == 0:
        torch.save(result, out)


def test_int8_state_on_shards_resumes_exactly(tmp_path):
    out = str(tmp_path / "int8.pt")
    run_distributed(int8_worker, 2, out, str(tmp_path / "ckpt"))
    got = torch.load(out)
    for a, b in zip(got["params"], got["resumed"]):
        assert torch.equal(a, b)
    # The same training in one process (other block boundaries and random bits: close, not equal).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 3))
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, state_dtype="int8", state_block_size=128)
    g = torch.Generator().manual_seed(1)
    for x, y in [(torch.randn(8, 64, generator=g), torch.randn(8, 3, generator=g)) for _ in range(5)]:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(got["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=5e-3)
