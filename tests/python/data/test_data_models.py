"""Datasets, data loaders and models of fusetrain.training.data / .models."""

import gzip
import os
import struct
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusetrain.training.data import loaders as data_mod
from fusetrain.training.data import (ImageFolderDataset, MNISTIdx, build_dataloaders, digits_dataset, read_idx,
                                     validate_dataset_params)
from fusetrain.models import MODEL_NAMES, SEED_MNIST_CFG, build_model


# ---- helpers --------------------------------------------------------------------------------------------------

def write_idx(path, array, gz=False, magic=None):
    """Write ``array`` (uint8) as an IDX file: 00 00 08 ndim, big-endian int32
    dims, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = magic if magic is not None else bytes([0, 0, 0x08, array.ndim])
    payload = header + b"".join(struct.pack(">i", d) for d in array.shape) + array.tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(payload)
    return path


def make_mnist(root, n_train=7, n_test=5, gz=False, seed=0, dotted=False):
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    out = {}
    for stem, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        sep = "." if dotted else "-"
        suffix = ".gz" if gz else ""
        write_idx(os.path.join(root, f"{stem}-images{sep}idx3-ubyte{suffix}"), images, gz)
        write_idx(os.path.join(root, f"{stem}-labels{sep}idx1-ubyte{suffix}"), labels, gz)
        out[stem] = (images, labels)
    return out


def make_image_folder(root, classes=("cat", "dog"), per_class=3, size=(8, 6), split_classes=None, seed=0):
    """root/{train,val}/<class>/<i>.png with random RGB pixels; returns
    {split: [(path, uint8 array HxWx3, label)]}."""
    Image = pytest.importorskip("PIL.Image", reason="image folders are decoded with Pillow")

    rng = np.random.default_rng(seed)
    out = {}
    for split in ("train", "val"):
        names = (split_classes or {}).get(split, classes)
        entries = []
        for label, cls in enumerate(sorted(names)):
            d = os.path.join(root, split, cls)
            os.makedirs(d, exist_ok=True)
            for i in range(per_class):
                arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                path = os.path.join(d, f"{i}.png")
                Image.fromarray(arr, "RGB").save(path)
                entries.append((path, arr, label))
        out[split] = entries
    return out


def _reference_digits(size):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.clamp(0, 1), torch.from_numpy(d.target.astype(np.int64))


def _multiset(images, labels):
    return Counter((img.numpy().tobytes(), int(lab)) for img, lab in zip(images, labels))


# ---- digits ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [8, 28])
def test_digits_split_is_a_fixed_partition(size):
    train, valid = digits_dataset(True, size), digits_dataset(False, size)
    xt, yt = train.tensors
    xv, yv = valid.tensors
    assert (len(train), len(valid)) == (1438, 359)
    assert xt.shape == (1438, 1, size, size) and xt.dtype == torch.float32 and yt.dtype == torch.int64
    assert 0.0 <= float(xt.min()) and float(xt.max()) <= 1.0 and float(xt.max()) > 0.9
    # Train + valid is exactly the whole data set (8x8 values / 16, bilinear upsampling).
    ref_x, ref_y = _reference_digits(size)
    assert _multiset(xt, yt) + _multiset(xv, yv) == _multiset(ref_x, ref_y)
    # Every class is in both splits.
    assert set(yt.tolist()) == set(range(10)) and set(yv.tolist()) == set(range(10))
    # Deterministic: the same split on every call.
    train2, valid2 = digits_dataset(True, size), digits_dataset(False, size)
    assert torch.equal(train2.tensors[0], xt) and torch.equal(valid2.tensors[1], yv)


def test_digits_split_matches_fixed_permutation():
    """The split is the seed-0 RandomState permutation: pin it down so a change
    of the split shows up here."""
    perm = np.random.RandomState(0).permutation(1797)
    ref_x, ref_y = _reference_digits(8)
    train = digits_dataset(True, 8)
    expected = np.sort(perm[:1438])
    assert torch.equal(train.tensors[0], ref_x[expected]) and torch.equal(train.tensors[1], ref_y[expected])


def test_digits_dataset_copies_and_rejects_bad_size():
    a = digits_dataset(True)
    a.tensors[0].zero_()
    assert float(digits_dataset(True).tensors[0].max()) > 0.9  # the cache is not shared with callers
    for bad in (0, -3, 2.5, True, "28"):
        with pytest.raises(ValueError, match="size"):
            digits_dataset(True, bad)


def _assert_load_digits(images, labels):
    """The raw arrays equal load_digits' (8x8 pixels 0..16 as float64, int64 labels)."""
    ref_x, ref_y = _reference_digits(8)
    assert images.shape == (1797, 8, 8) and images.dtype == np.float64 and labels.dtype == np.int64
    assert torch.equal(torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1), ref_x)
    assert torch.equal(torch.from_numpy(labels), ref_y)


def test_digits_are_read_without_importing_sklearn(monkeypatch):
    # NOTE [digits without importing scikit-learn]: the CSV in scikit-learn's package, read directly; the
    # import of sklearn (through fusetrain._optional.require) is left for a package without that file.
    from fusetrain import _optional
    from fusetrain.training.data import classification

    def no_import(module, purpose):
        raise AssertionError(f"imported {module} for {purpose}")

    monkeypatch.setattr(_optional, "require", no_import)
    _assert_load_digits(*classification._digits_arrays())


def test_digits_fall_back_to_load_digits_without_the_csv(monkeypatch, tmp_path):
    # Another layout of scikit-learn's package (no datasets/data/digits.csv.gz): load_digits reads them.
    import importlib.machinery
    import importlib.util

    from fusetrain.training.data import classification

    real = importlib.util.find_spec
    spec = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sklearn" else real(name, *a))
    import sklearn.datasets

    calls = []
    load_digits = sklearn.datasets.load_digits
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: calls.append(1) or load_digits())
    arrays = classification._digits_arrays()
    assert calls == [1]
    _assert_load_digits(*arrays)


# ---- MNIST IDX ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_mnist_idx_reads_both_splits(tmp_path, gz):
    ref = make_mnist(str(tmp_path), gz=gz)
    for train, stem in ((True, "train"), (False, "t10k")):
        ds = MNISTIdx(str(tmp_path), train=train)
        images, labels = ref[stem]
        assert len(ds) == len(labels)
        for i in (0, len(ds) - 1):
            x, y = ds[i]
            assert x.shape == (1, 28, 28) and x.dtype == torch.float32
            torch.testing.assert_close(x[0], torch.from_numpy(images[i]).float() / 255.0, rtol=0, atol=0)
            assert y.dtype == torch.int64 and int(y) == int(labels[i])
        assert ds.images_path.endswith(".gz") == gz


def test_mnist_idx_alternative_layouts(tmp_path):
    # torchvision's download layout root/MNIST/raw, and the dotted file names.
    make_mnist(str(tmp_path / "a" / "MNIST" / "raw"), n_train=4)
    assert len(MNISTIdx(str(tmp_path / "a"), train=True)) == 4
    make_mnist(str(tmp_path / "b"), n_train=6, dotted=True)
    assert len(MNISTIdx(str(tmp_path / "b"), train=True)) == 6


def test_mnist_transform_is_applied(tmp_path):
    make_mnist(str(tmp_path))
    ds = MNISTIdx(str(tmp_path), train=False, transform=lambda t: t * 2 - 1)
    x, _ = ds[0]
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0 and float(x.min()) < 0


def test_mnist_missing_directory_and_files(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="MNIST directory not found: .*nope"):
        MNISTIdx(str(missing))
    with pytest.raises(ValueError, match="root"):
        MNISTIdx("")
    make_mnist(str(tmp_path))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    assert len(MNISTIdx(str(tmp_path), train=True)) == 7  # the train split is complete
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        MNISTIdx(str(tmp_path), train=False)


def test_mnist_malformed_files(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8)
    labels = np.array([1, 2, 3], dtype=np.uint8)

    def setup(name, img_kwargs=None, lab=labels):
        d = tmp_path / name
        d.mkdir()
        write_idx(d / "train-images-idx3-ubyte", images, **(img_kwargs or {}))
        write_idx(d / "train-labels-idx1-ubyte", lab)
        return d

    d = setup("magic", {"magic": b"\x12\x34\x08\x03"})
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: not an IDX file \(bad magic number 12340803"):
        MNISTIdx(str(d))
    d = setup("dtype", {"magic": b"\x00\x00\x07\x03"})
    with pytest.raises(ValueError, match="bad magic number 00000703"):
        MNISTIdx(str(d))
    # Header says 3 x 28 x 28 but one byte is missing.
    d = setup("short")
    path = d / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError,
                       match=r"train-images-idx3-ubyte: IDX size mismatch: header says shape \(3, 28, 28\)"):
        MNISTIdx(str(d))
    # Truncated header.
    d = setup("header")
    (d / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03\x00\x00")
    with pytest.raises(ValueError, match="truncated IDX header"):
        MNISTIdx(str(d))
    # Labels in place of images (1-d).
    d = setup("swapped")
    write_idx(d / "train-images-idx3-ubyte", labels)
    with pytest.raises(ValueError, match=r"expected a 3-d image array"):
        MNISTIdx(str(d))
    # Counts disagree.
    d = setup("count", lab=np.array([1, 2], dtype=np.uint8))
    with pytest.raises(ValueError, match="holds 3 images but .* holds 2 labels"):
        MNISTIdx(str(d))
    # A .gz file that is not gzip.
    d = tmp_path / "badgz"
    d.mkdir()
    (d / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    write_idx(d / "train-labels-idx1-ubyte", labels)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: cannot read the file"):
        MNISTIdx(str(d))
    with pytest.raises(FileNotFoundError, match="IDX file not found"):
        read_idx(str(tmp_path / "missing-idx3-ubyte"))


def test_read_idx_other_dtypes(tmp_path):
    arr = (np.arange(6).reshape(2, 3) - 2).astype(">i4")  # big-endian, as IDX stores it
    path = tmp_path / "x.idx"
    path.write_bytes(bytes([0, 0, 0x0C, 2]) + struct.pack(">ii", 2, 3) + arr.tobytes())
    out = read_idx(str(path))
    assert out.dtype == np.int32 and out.tolist() == [[-2, -1, 0], [1, 2, 3]]


# ---- image folders --------------------------------------------------------------------------------------------

def test_image_folder_reads_images_and_labels(tmp_path):
    ref = make_image_folder(str(tmp_path))
    ds = ImageFolderDataset(str(tmp_path / "train"))
    assert ds.classes == ["cat", "dog"] and ds.class_to_idx == {"cat": 0, "dog": 1}
    assert len(ds) == 6 and ds.targets == [0, 0, 0, 1, 1, 1]
    for i, (path, arr, label) in enumerate(ref["train"]):
        x, y = ds[i]
        assert ds.samples[i][0] == path
        assert x.shape == (3, 6, 8) and x.dtype == torch.float32
        torch.testing.assert_close(x, torch.from_numpy(arr).permute(2, 0, 1).float() / 255.0, rtol=0, atol=0)
        assert int(y) == label and y.dtype == torch.int64


def test_image_folder_grayscale_and_resize(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="image folders are decoded with Pillow")
    ref = make_image_folder(str(tmp_path), per_class=1)
    gray = ImageFolderDataset(str(tmp_path / "val"), channels=1)
    x, _ = gray[0]
    expected = np.array(Image.open(ref["val"][0][0]).convert("L"))
    assert x.shape == (1, 6, 8)
    torch.testing.assert_close(x[0], torch.from_numpy(expected).float() / 255.0, rtol=0, atol=0)
    resized = ImageFolderDataset(str(tmp_path / "val"), image_size=4)
    assert resized[1][0].shape == (3, 4, 4)


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory not found: .*absent"):
        ImageFolderDataset(str(tmp_path / "absent"))
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(b"")
    with pytest.raises(ValueError, match="no class sub-folders"):
        ImageFolderDataset(str(tmp_path / "flat"))
    make_image_folder(str(tmp_path / "ds"), per_class=1)
    (tmp_path / "ds" / "train" / "empty").mkdir()
    (tmp_path / "ds" / "train" / "empty" / "notes.txt").write_text("no images")
    with pytest.raises(ValueError, match=r"class folder\(s\) \['empty'\] .* hold no image files"):
        ImageFolderDataset(str(tmp_path / "ds" / "train"))
    with pytest.raises(ValueError, match="channels"):
        ImageFolderDataset(str(tmp_path / "ds" / "val"), channels=2)
    # A file with an image extension that is not an image fails when read, naming it.
    (tmp_path / "ds" / "val" / "cat" / "broken.png").write_bytes(b"garbage")
    ds = ImageFolderDataset(str(tmp_path / "ds" / "val"))
    broken = [i for i, (p, _) in enumerate(ds.samples) if p.endswith("broken.png")][0]
    with pytest.raises(ValueError, match="cannot decode image .*broken.png"):
        ds[broken]


def test_build_dataloaders_image_folder(tmp_path):
    make_image_folder(str(tmp_path), per_class=5)
    train, valid = build_dataloaders({"name": "image_folder", "root": str(tmp_path), "batch_size": 4,
                                      "valid_batch_size": 3, "drop_last": True})
    assert len(train.dataset) == 10 and len(valid.dataset) == 10
    assert len(train) == 2 and len(valid) == 4  # drop_last only on the train loader
    x, y = next(iter(train))
    assert x.shape == (4, 3, 6, 8) and y.dtype == torch.int64

    with pytest.raises(FileNotFoundError, match="directory not found: .*missing"):
        build_dataloaders({"name": "image_folder", "root": str(tmp_path / "missing")})
    only_train = tmp_path / "only_train"
    make_image_folder(str(only_train), per_class=1)
    import shutil
    shutil.rmtree(only_train / "val")
    with pytest.raises(FileNotFoundError, match="has no val/ sub-folder"):
        build_dataloaders({"name": "image_folder", "root": str(only_train)})
    mismatch = tmp_path / "mismatch"
    make_image_folder(str(mismatch), per_class=1, split_classes={"val": ("cat", "cow")})
    with pytest.raises(ValueError, match="class folders of .* differ"):
        build_dataloaders({"name": "image_folder", "root": str(mismatch)})


# ---- dataset_params -------------------------------------------------------------------------------------------

def test_build_dataloaders_digits_defaults_and_seeded_shuffle():
    train, valid = build_dataloaders({"name": "digits"})
    assert train.batch_size == 64 and valid.batch_size == 64 and train.num_workers == 0
    assert len(train.dataset) == 1438 and len(valid.dataset) == 359
    assert isinstance(train.generator, torch.Generator)

    def first_labels(seed):
        t, _ = build_dataloaders({"name": "digits", "seed": seed, "batch_size": 32})
        return next(iter(t))[1]

    assert torch.equal(first_labels(3), first_labels(3))
    assert not torch.equal(first_labels(3), first_labels(4))
    # shuffle=False keeps the split's order; image_size is honoured.
    t, v = build_dataloaders({"name": "digits", "shuffle": False, "batch_size": 10, "image_size": 16})
    x, y = next(iter(t))
    assert x.shape == (10, 1, 16, 16) and torch.equal(y, digits_dataset(True, 16).tensors[1][:10])


def test_build_dataloaders_mnist(tmp_path):
    ref = make_mnist(str(tmp_path), n_train=9, n_test=4, gz=True)
    train, valid = build_dataloaders({"name": "mnist", "root": str(tmp_path), "batch_size": 4, "shuffle": False})
    x, y = next(iter(train))
    assert x.shape == (4, 1, 28, 28)
    assert torch.equal(y, torch.from_numpy(ref["train"][1][:4].astype(np.int64)))
    assert len(valid.dataset) == 4
    with pytest.raises(FileNotFoundError, match="nope"):
        build_dataloaders({"name": "mnist", "root": str(tmp_path / "nope")})


def test_mnist_without_root_falls_back_to_digits_and_warns_once(monkeypatch):
    monkeypatch.setattr(data_mod, "_warned_mnist_fallback", False)
    with pytest.warns(UserWarning, match="embedded scikit-learn digits resized to 28x28"):
        train, valid = build_dataloaders({"name": "mnist", "root": None, "batch_size": 16})
    assert len(train.dataset) == 1438 and len(valid.dataset) == 359
    assert next(iter(train))[0].shape == (16, 1, 28, 28)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_dataloaders({"name": "mnist"})  # second time: no warning


@pytest.mark.parametrize("params, match", [
    ({"name": "digits", "batchsize": 3}, r"unknown key 'batchsize' for dataset 'digits'; allowed keys: .*batch_size"),
    ({"name": "digits", "root": "/x"}, r"unknown key 'root' for dataset 'digits'"),
    ({"name": "mnist", "image_size": 28}, r"unknown key 'image_size' for dataset 'mnist'"),
    ({"name": "cifar"}, r"dataset_params.name: got 'cifar'; allowed: 'digits', 'mnist', 'image_folder'"),
    ({"batch_size": 3}, r"dataset_params.name is required"),
    ({"name": "digits", "batch_size": 0}, r"dataset_params.batch_size: got 0 \(int\); allowed: an int >= 1"),
    ({"name": "digits", "batch_size": True}, r"dataset_params.batch_size: got True \(bool\)"),
    ({"name": "digits", "num_workers": -1}, r"dataset_params.num_workers: got -1"),
    ({"name": "digits", "shuffle": "yes"}, r"dataset_params.shuffle: got 'yes' \(str\); allowed: a bool"),
    ({"name": "digits", "seed": -1}, r"dataset_params.seed"),
    ({"name": "image_folder"}, r"dataset_params.root is required for the 'image_folder' dataset"),
    ({"name": "image_folder", "root": None}, r"dataset_params.root: got None"),
    ({"name": "image_folder", "root": "/x", "channels": 4}, r"dataset_params.channels: got 4"),
])
def test_dataset_params_errors(params, match):
    with pytest.raises(ValueError, match=match):
        build_dataloaders(params)


def test_validate_dataset_params_fills_defaults():
    p = validate_dataset_params({"name": "digits", "batch_size": 8})
    assert p == {"name": "digits", "batch_size": 8, "valid_batch_size": 8, "num_workers": 0, "shuffle": True,
                 "drop_last": False, "pin_memory": False, "seed": 0, "image_size": 28}
    with pytest.raises(ValueError, match="expected a mapping"):
        validate_dataset_params(["digits"])


# ---- models ---------------------------------------------------------------------------------------------------

class _DocBlock(nn.Module):
    """The seed document's BasicBlock, transcribed."""

    def __init__(self, **kwargs):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(**kwargs), nn.BatchNorm2d(num_features=kwargs["out_channels"]), nn.ReLU())

    def forward(self, x):
        return self.block(x)


class _DocModel(nn.Module):
    """The seed document's Model(cfg), transcribed."""

    CFG = [[1, 32, 3, 1, 1], [32, 64, 3, 1, 1], [64, 64, 2, 2, 0], [64, 128, 3, 1, 1], [128, 128, 3, 1, 1],
           [128, 128, 3, 1, 1], [128, 128, 2, 2, 0], [128, 256, 3, 1, 1], [256, 256, 2, 1, 0], [256, 512, 3, 1, 1],
           [512, 512, 3, 1, 1], [512, 512, 3, 1, 1], [512, 512, 2, 2, 0], [512, 1024, 3, 1, 1]]

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(*[_DocBlock(in_channels=c[0], out_channels=c[1], kernel_size=c[2], stride=c[3],
                                                  padding=c[4]) for c in self.CFG])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(1024, 1000), nn.ReLU(), nn.Linear(1000, 1000),
                                        nn.ReLU(), nn.Linear(1000, 10))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


def test_seed_mnist_is_the_document_network():
    model = build_model("seed_mnist")
    assert SEED_MNIST_CFG == _DocModel.CFG
    # Parameter count by formula: conv weight + bias, BN weight + bias, then the three linears.
    conv = sum(ci * co * k * k + co + 2 * co for ci, co, k, _, _ in SEED_MNIST_CFG)
    linear = 1024 * 1000 + 1000 + 1000 * 1000 + 1000 + 1000 * 10 + 10
    n = sum(p.numel() for p in model.parameters())
    assert n == conv + linear == 14_740_522
    # Same modules, names and shapes as the document's model: its state_dict loads
    # strictly and the two give identical outputs.
    ref = _DocModel()
    assert [(k, v.shape) for k, v in model.state_dict().items()] == \
        [(k, v.shape) for k, v in ref.state_dict().items()]
    from fusetrain.models import BasicBlock
    as_doc = {BasicBlock: _DocBlock}
    assert [as_doc.get(type(m), type(m)) for m in model.modules()][1:] == [type(m) for m in ref.modules()][1:]
    model.load_state_dict(ref.state_dict(), strict=True)
    model.eval()
    ref.eval()
    x = torch.rand(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    block = model.features[0].block
    assert isinstance(block[0], nn.Conv2d) and block[0].bias is not None
    assert isinstance(block[1], nn.BatchNorm2d) and isinstance(block[2], nn.ReLU)


@pytest.mark.parametrize("name, kwargs, shape, n_out", [
    ("digits_cnn", {}, (3, 1, 28, 28), 10),
    ("digits_cnn", {"num_classes": 5, "in_channels": 3, "width": 8}, (2, 3, 8, 8), 5),
    ("seed_mnist", {"num_classes": 7, "in_channels": 3}, (2, 3, 28, 28), 7),
    ("cifar_resnet", {}, (2, 3, 32, 32), 10),
    ("cifar_resnet", {"depth": 8, "num_classes": 100, "in_channels": 1, "width": 4}, (2, 1, 32, 32), 100),
])
def test_model_output_shapes(name, kwargs, shape, n_out):
    torch.manual_seed(0)
    model = build_model(name, **kwargs)
    out = model(torch.rand(*shape))
    assert out.shape == (shape[0], n_out) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cifar_resnet_depth_and_parameters():
    def n_params(m):
        return sum(p.numel() for p in m.parameters())

    def convs(m):
        return [c for c in m.modules() if isinstance(c, nn.Conv2d)]

    r20 = build_model("cifar_resnet")
    # 1 stem conv + 3 stages x 3 blocks x 2 convs = 19 3x3 convs, plus two 1x1 projections.
    assert sum(c.kernel_size == (3, 3) for c in convs(r20)) == 19
    assert sum(c.kernel_size == (1, 1) for c in convs(r20)) == 2
    # 16-32-64 channels: 3x3 convs + projections + BN + fc, counted by hand.
    k3 = 3 * 16 * 9 + 6 * 16 * 16 * 9 + (16 * 32 + 5 * 32 * 32) * 9 + (32 * 64 + 5 * 64 * 64) * 9
    proj = 16 * 32 + 32 * 64
    bn = 2 * (16 + 6 * 16 + 6 * 32 + 32 + 6 * 64 + 64)
    assert n_params(r20) == k3 + proj + bn + 64 * 10 + 10
    r32 = build_model("cifar_resnet", depth=32)
    assert sum(c.kernel_size == (3, 3) for c in convs(r32)) == 31
    for bad in (21, 6, 0):
        with pytest.raises(ValueError, match="depth must be 6n \\+ 2"):
            build_model("cifar_resnet", depth=bad)


def test_build_model_errors():
    assert MODEL_NAMES == ("cifar_resnet", "ddrnet", "digits_cnn", "pplite_seg", "seed_mnist", "yolo_csp")
    with pytest.raises(ValueError, match="unknown model 'resnet50'; allowed: cifar_resnet, ddrnet, digits_cnn, "
                                         "pplite_seg, seed_mnist, yolo_csp"):
        build_model("resnet50")
    with pytest.raises(ValueError, match="unknown key 'depth' for model 'digits_cnn'; allowed keys: name, "
                                         "num_classes, in_channels, width, dropout"):
        build_model("digits_cnn", depth=3)
    with pytest.raises(ValueError, match="num_classes must be an int >= 1, got 0"):
        build_model("seed_mnist", num_classes=0)
    with pytest.raises(ValueError, match="dropout"):
        build_model("digits_cnn", dropout=1.5)
