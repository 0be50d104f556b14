"""The Python half of the conformance suite: every case of
tests/conformance/cases.txt run through fusetrain's Python front end
(optimizers, LossScaler, attached ModelEMA) must give bit-identical weights,
optimizer state, EMA and loss scale to the C++ front end, whose results the
GoogleTest binary writes (tests/cpp/test_conformance.cpp). Both front ends
call the same core ops, so any difference is logic written twice."""

import os
import subprocess

import pytest
import torch
from torch import nn

import fusetrain
from _test_helpers import REPO
from fusetrain.optim import SGD, Adadelta, Adam, AdamP, AdamW, Lamb, Lion, Muon, NAdam, RAdam, RMSprop, RMSpropTF

SHAPES = [(7,), (13, 5), (3, 4, 2)]
DEFAULTS = {"optimizer": "adamw", "dtype": "fp32", "master": "0", "clip": "0", "amsgrad": "0", "bias_correction": "1",
            "scaler": "0",
            "ema": "0", "accumulate": "1", "steps": "4", "inf_step": "-1", "lr": "0.01", "lr_decay": "1",
            "seed": "0", "groups": "1"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "mu_product", "master_param")


def read_cases():
    cases = []
    with open(os.path.join(REPO, "tests", "conformance", "cases.txt")) as f:
        for line in f:
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            case = dict(DEFAULTS, name=words[0])
            for kv in words[1:]:
                key, _, value = kv.partition("=")
                assert key in DEFAULTS, f"unknown key {key!r} in case {words[0]}"
                case[key] = value
            cases.append(case)
    return cases


class Toy(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        for i, shape in enumerate(SHAPES):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape).to(dtype)))
        self.register_buffer("running", torch.zeros(5))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


def make_optimizer(c, params):
    lr, clip = float(c["lr"]), float(c["clip"]) or None
    common = dict(lr=lr, max_grad_norm=clip, master_weights=c["master"] == "1")
    if c["groups"] == "2":  # the last param in a group of its own without weight decay
        params = [dict(params=params[:-1]), dict(params=params[-1:], weight_decay=0.0)]
    if c["optimizer"] == "adam":
        return Adam(params, betas=(0.9, 0.99), weight_decay=0.01, amsgrad=c["amsgrad"] == "1",
                    bias_correction=c["bias_correction"] == "1", **common)
    if c["optimizer"] == "adamw":
        return AdamW(params, betas=(0.9, 0.99), weight_decay=0.05, amsgrad=c["amsgrad"] == "1",
                     bias_correction=c["bias_correction"] == "1", **common)
    if c["optimizer"] == "sgd":
        return SGD(params, momentum=0.9, nesterov=True, weight_decay=0.01, **common)
    if c["optimizer"] == "rmsprop":
        return RMSprop(params, alpha=0.9, weight_decay=0.01, momentum=0.5, centered=True, **common)
    if c["optimizer"] == "rmsprop_tf":
        return RMSpropTF(params, alpha=0.9, eps=1e-3, weight_decay=0.01, momentum=0.9, decoupled_decay=True,
                         **common)
    if c["optimizer"] == "muon":  # one group given: Muon splits it into the matrices' group and the vector's
        assert c["groups"] == "1", "the muon cases take groups=1"
        return Muon(params, weight_decay=0.05, adjust_lr_fn="match_rms_adamw", **common)
    if c["optimizer"] == "adadelta":
        return Adadelta(params, rho=0.8, weight_decay=0.01, **common)
    if c["optimizer"] == "radam":
        return RAdam(params, betas=(0.9, 0.99), weight_decay=0.05, decoupled_weight_decay=True, **common)
    if c["optimizer"] == "nadam":
        return NAdam(params, betas=(0.9, 0.99), weight_decay=0.05, momentum_decay=0.01, decoupled_weight_decay=True,
                     **common)
    if c["optimizer"] == "lamb":
        return Lamb(params, weight_decay=0.05, trust_clip=True, **common)
    if c["optimizer"] == "adamp":
        return AdamP(params, weight_decay=0.05, delta=1.0, nesterov=True, **common)
    assert c["optimizer"] == "lion", c["optimizer"]
    return Lion(params, betas=(0.9, 0.99), weight_decay=0.1, **common)


@torch.no_grad()
def run_case(c):
    """The same loop as run_case in tests/cpp/test_conformance.cpp."""
    name, dtype = c["name"], DTYPES[c["dtype"]]
    torch.manual_seed(int(c["seed"]))
    model = Toy(dtype)
    opt = make_optimizer(c, list(model.parameters()))
    ema = None
    if c["ema"] == "1":
        ema = fusetrain.ModelEMA(model, decay=0.99, decay_type="threshold", warmup=True, warmup_power=0.75)
        ema.attach(opt)
    scaler = fusetrain.LossScaler(init_scale=1024.0, growth_interval=2) if c["scaler"] == "1" else None
    lr = float(c["lr"])
    for step in range(int(c["steps"])):
        scale = 1.0
        if scaler is not None:
            scaler.scale(torch.ones(()))
            scale = scaler.get_scale()
        for micro in range(int(c["accumulate"])):
            for p in model.parameters():
                g = (torch.randn(p.shape) * scale).to(dtype)
                if micro == 0:
                    p.grad = g
                else:
                    p.grad.add_(g)
            model.running.add_(torch.randn(5) * 0.1)
            model.count.add_(1)
        if step == int(c["inf_step"]):
            model.p1.grad.view(-1)[3] = float("inf")
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        lr *= float(c["lr_decay"])
        for group in opt.param_groups:
            group["lr"] = lr
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"{name}/param/{i}"] = p
        for key in STATE_KEYS:
            if key in opt.state[p]:
                out[f"{name}/state/{i}/{key}"] = opt.state[p][key]
    for key, b in model.named_buffers():
        out[f"{name}/buffer/{key}"] = b
    if ema is not None:
        for key, t in list(ema.module.named_parameters()) + list(ema.module.named_buffers()):
            out[f"{name}/ema/{key}"] = t
        out[f"{name}/ema_step"] = ema.step_tensor
    if scaler is not None:
        out[f"{name}/scale"] = scaler.get_scale_tensor()
        out[f"{name}/growth_tracker"] = scaler._growth_tracker
        out[f"{name}/skipped_steps"] = scaler.skipped_steps
    out[f"{name}/found_inf"] = opt.last_found_inf
    return out


def cpp_binary():
    path = os.environ.get("FUSETRAIN_CPP_TESTS", os.path.join(REPO, "build", "py", "fusetrain_cpp_tests"))
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def cpp_results(tmp_path_factory):
    binary = cpp_binary()
    if binary is None:
        pytest.skip("the GoogleTest binary is not built (bash scripts/setup builds it into build/py; "
                    "or set FUSETRAIN_CPP_TESTS to its path)")
    out = tmp_path_factory.mktemp("conformance") / "cpp.pt"
    env = dict(os.environ, FUSETRAIN_CONFORMANCE_OUT=str(out))
    proc = subprocess.run([binary, "--gtest_filter=Conformance.*"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # torch::pickle_save tags the dict's types with this function.
    import torch.jit._pickle

    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(out, weights_only=True)


def test_cases_file_is_well_formed():
    cases = read_cases()
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names)) >= 5
    # The suite covers what the front ends must agree on.
    assert {c["optimizer"] for c in cases} >= {"adam", "adamw", "sgd", "lion"}
    for key in ("scaler", "ema", "master"):
        assert any(c[key] == "1" for c in cases), key
    assert any(c["inf_step"] != "-1" for c in cases) and any(c["accumulate"] != "1" for c in cases)
    assert any(c["clip"] != "0" for c in cases) and any(c["lr_decay"] != "1" for c in cases)
    assert any(c["groups"] == "2" for c in cases)


@pytest.mark.parametrize("case", read_cases(), ids=lambda c: c["name"])
def test_python_and_cpp_front_ends_are_bit_identical(case, cpp_results):
    ours = run_case(case)
    theirs = {k: v for k, v in cpp_results.items() if k.startswith(case["name"] + "/")}
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        other = theirs[key]
        assert value.dtype == other.dtype and value.shape == other.shape, key
        assert torch.equal(value, other), f"{key}: max |diff| {(value.double() - other.double()).abs().max()}"
