"""Starting from pretrained weights: pretrained_weights/pretrained_params
(state dict layouts, key prefixes, a new head, strict), freeze and
freeze_bn_stats, lr_multipliers and layer_decay, on their own and through
the Trainer with a torchvision ResNet state dict."""

import math
import os

import pytest
import torch
import torchvision
from torch import nn

from fusetrain.training import finetune
from fusetrain.training.checkpoint.files import load_checkpoint
from fusetrain.training.data import build_dataloaders
from fusetrain.training.params import TrainingParamsError, resolve_training_params
from fusetrain.training.trainer import Trainer

from _train_helpers import one_thread  # noqa: F401  (fixture)


def net(classes=10, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, classes))


def save(obj, tmp_path, name="w.pth"):
    path = str(tmp_path / name)
    torch.save(obj, path)
    return path


# ---- loading ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["plain", "state_dict", "fusetrain", "module", "ddp"])
def test_every_layout_loads_and_a_new_head_is_skipped_and_reported(tmp_path, layout):
    src, dst = net(classes=100, seed=1), net(classes=10, seed=2)
    sd = src.state_dict()
    obj = {"plain": sd, "state_dict": {"state_dict": sd, "epoch": 3}, "fusetrain": {"model": sd, "epoch": 1},
           "module": src, "ddp": {f"module.{k}": v for k, v in sd.items()}}[layout]
    head_before = dst[4].weight.detach().clone()
    report = finetune.load_pretrained(dst, save(obj, tmp_path))
    assert torch.equal(dst[0].weight, src[0].weight) and torch.equal(dst[1].running_var, src[1].running_var)
    assert torch.equal(dst[4].weight, head_before)  # the new head keeps its own init
    assert report["mismatched"] == ["4.weight: (100, 144) -> (10, 144)", "4.bias: (100,) -> (10,)"]
    assert report["missing"] == [] and report["unexpected"] == []
    assert len(report["loaded"]) == len(sd) - 2


def test_key_map_strict_and_errors(tmp_path):
    src = net(seed=1)
    path = save({f"backbone.{k}": v for k, v in src.state_dict().items()}, tmp_path)
    dst = net(seed=2)
    with pytest.raises(ValueError, match=r"pretrained_weights: none of the 9 tensors .*pretrained_params.key_map"):
        finetune.load_pretrained(dst, path)
    report = finetune.load_pretrained(dst, path, key_map={"backbone.": ""}, strict=True)
    assert not report["mismatched"] and torch.equal(dst[4].weight, src[4].weight)
    extra = save({**src.state_dict(), "aux.weight": torch.ones(2)}, tmp_path, "extra.pth")
    with pytest.raises(ValueError, match=r"strict is true\): unexpected: aux.weight"):
        finetune.load_pretrained(dst, extra, strict=True)
    assert finetune.load_pretrained(dst, extra)["unexpected"] == ["aux.weight"]
    with pytest.raises(FileNotFoundError, match="pretrained_weights: no file at"):
        finetune.load_pretrained(dst, str(tmp_path / "missing.pth"))
    with pytest.raises(ValueError, match="use_ema: .* has no EMA weights"):
        finetune.load_pretrained(dst, path, use_ema=True)
    ema_ck = save({"model": net(seed=3).state_dict(), "ema": {"module": src.state_dict(), "step": 1}}, tmp_path)
    finetune.load_pretrained(dst, ema_ck, use_ema=True, strict=True)
    assert torch.equal(dst[0].weight, src[0].weight)


# ---- freezing and lr multipliers -------------------------------------------------------------------------


def test_freeze_patterns_and_frozen_bn():
    m = net()
    assert finetune.freeze(m, ["0", "1.*"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert [q.requires_grad for q in m.parameters()] == [False] * 4 + [True] * 2
    assert finetune.frozen_bn_modules(m) == [m[1]]
    with pytest.raises(ValueError, match=r"freeze: \['head'\] match\(es\) no parameter"):
        finetune.freeze(net(), ["head"])
    all_frozen = net()
    finetune.freeze(all_frozen, ["*"])
    with pytest.raises(ValueError, match="no trainable parameters"):
        finetune.param_groups(all_frozen, False, {}, None)


def test_groups_split_by_multiplier_and_weight_decay():
    m = net()
    groups = finetune.param_groups(m, True, {"4": 0.5, "*.weight": 0.1}, None)
    got = [(g["lr_scale"], g.get("weight_decay"), [q.shape for q in g["params"]]) for g in groups]
    assert got == [(0.1, None, [torch.Size([4, 1, 3, 3])]), (1.0, 0.0, [torch.Size([4])] * 2),
                   (0.1, 0.0, [torch.Size([4])]), (0.5, None, [torch.Size([10, 144])]),
                   (0.5, 0.0, [torch.Size([10])])]
    with pytest.raises(ValueError, match=r"lr_multipliers: \['backbone'\] match\(es\) no trainable parameter"):
        finetune.param_groups(m, False, {"backbone": 0.1}, None)


def test_layer_decay_counts_blocks_from_the_head():
    class ViTish(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(2, 2)
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.head = nn.Linear(2, 2)

    scales = finetune.lr_scales(ViTish(), {"head": 2.0}, {"rate": 0.5, "pattern": r"blocks\.(\d+)\."})
    assert scales["embed.weight"] == 0.5 ** 4 and scales["blocks.0.weight"] == 0.5 ** 3
    assert scales["blocks.2.bias"] == 0.5 and scales["head.weight"] == 2.0
    with pytest.raises(ValueError, match="layer_decay.pattern"):
        finetune.lr_scales(net(), {}, {"rate": 0.5, "pattern": r"blocks\.(\d+)\."})


def test_bad_params_are_rejected_before_training():
    with pytest.raises(TrainingParamsError, match="lr_multipliers"):
        resolve_training_params({"lr_multipliers": {"backbone": 0}})
    with pytest.raises(TrainingParamsError, match="pretrained_params: unknown key 'strickt'"):
        resolve_training_params({"pretrained_params": {"strickt": True}})
    with pytest.raises(TrainingParamsError, match="layer_decay"):
        resolve_training_params({"layer_decay": {"rate": 0.75, "pattern": "blocks\\.\\d+"}})


# ---- through the Trainer ------------------------------------------------------------------------------------


class GreyResNet(nn.Module):
    """torchvision's ResNet-18 under ``net`` for 1-channel digits."""

    def __init__(self, classes):
        super().__init__()
        self.net = torchvision.models.resnet18(num_classes=classes)

    def forward(self, x):
        return self.net(x.expand(-1, 3, -1, -1))


def test_torchvision_resnet_state_dict_into_a_new_head_with_frozen_backbone(tmp_path):
    torch.manual_seed(0)
    published = torchvision.models.resnet18(num_classes=1000)
    published.bn1.running_mean.uniform_(-1, 1)  # statistics a frozen BatchNorm must keep
    path = save(published.state_dict(), tmp_path, "resnet18.pth")
    model = GreyResNet(10)
    fc_before = model.net.fc.weight.detach().clone()
    tl, vl = build_dataloaders({"name": "digits", "batch_size": 16, "image_size": 32})
    frozen = ("net.conv1", "net.bn1", "net.layer1")
    params = dict(max_epochs=1, max_train_batches=3, max_valid_batches=1, progress_bar=False, device="cpu",
                  optimizer="SGD", optimizer_params={"momentum": 0.9, "weight_decay": 1e-4}, initial_lr=0.05,
                  lr_mode="cosine", pretrained_weights=path, pretrained_params={"key_map": {"": "net."}},
                  freeze=["net.conv1", "net.bn1", "net.layer1"], freeze_bn_stats=True,
                  lr_multipliers={"net.layer2": 0.5, "net.layer3": 0.1}, zero_weight_decay_on_bias_and_bn=True)
    with pytest.warns(UserWarning, match=r"mismatched \(2\): net.fc.weight: \(1000, 512\) -> \(10, 512\)"):
        result = Trainer("ft", ckpt_root_dir=str(tmp_path)).train(model, params, tl, vl)
    assert result["pretrained"]["mismatched"] == ["net.fc.weight: (1000, 512) -> (10, 512)",
                                                  "net.fc.bias: (1000,) -> (10,)"]
    sd = {f"net.{k}": v for k, v in published.state_dict().items()}
    for name, t in model.state_dict().items():
        if name.startswith(frozen):  # frozen: weights and BatchNorm statistics untouched
            assert torch.equal(t, sd[name]), name
    for name in ("net.layer2.0.conv1.weight", "net.layer3.0.conv1.weight", "net.layer4.0.bn1.running_mean"):
        assert not torch.equal(model.state_dict()[name], sd[name]), name
    assert not torch.equal(model.net.fc.weight, fc_before)
    # The optimizer's groups: frozen params left out, one group per (multiplier, weight decay), each at the
    # schedule's last lr times its multiplier.
    ck = load_checkpoint(os.path.join(result["run_dir"], "ckpt_latest.pth"))
    groups = ck["optimizer"]["param_groups"]
    named = dict(model.named_parameters())
    trainable = [n for n in named if not n.startswith(frozen)]
    multipliers = params["lr_multipliers"]
    key = {n: (next((v for k, v in multipliers.items() if n.startswith(k + ".")), 1.0), named[n].dim() <= 1)
           for n in trainable}
    # A state dict numbers the params group after group; groups come in order of first appearance of their
    # (multiplier, no weight decay) pair, each holding its params in model order.
    order = list(dict.fromkeys(key[n] for n in trainable))
    by_index = [n for k in order for n in trainable if key[n] == k]
    assert sorted(i for g in groups for i in g["params"]) == list(range(len(trainable)))
    last = 0.05 * 0.01  # cosine's final ratio 0.01 at the last step
    for g in groups:
        for i in g["params"]:
            scale, no_decay = key[by_index[i]]
            assert g["lr_scale"] == scale and (g["weight_decay"] == 0.0) == no_decay, by_index[i]
        assert float(g["lr"]) == pytest.approx(last * g["lr_scale"], rel=1e-6)  # float32 device lr


def test_multipliers_survive_resume_and_follow_the_config(tmp_path):
    torch.manual_seed(0)
    tl, vl = build_dataloaders({"name": "digits", "batch_size": 16, "image_size": 8})
    params = dict(max_epochs=2, max_train_batches=2, max_valid_batches=1, progress_bar=False, device="cpu",
                  initial_lr=0.01, lr_multipliers={"1.0": 0.25})
    model = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    mlp = nn.Sequential(nn.Flatten(), model)
    trainer = Trainer("res", ckpt_root_dir=str(tmp_path))
    trainer.train(mlp, {**params, "max_epochs": 1}, tl, vl)
    result = trainer.train(mlp, {**params, "resume": True, "lr_multipliers": {"1.0": 0.5}}, tl, vl)
    # The config's multiplier (0.5) replaces the checkpoint's (0.25); the groups stay the same.
    groups = load_checkpoint(os.path.join(result["run_dir"], "ckpt_latest.pth"))["optimizer"]["param_groups"]
    assert [g["lr_scale"] for g in groups] == [0.5, 1.0]
    assert [float(g["lr"]) for g in groups] == pytest.approx([0.005, 0.01])
    assert math.isfinite(result["final"]["train_loss"])
