"""fusetrain::gated_copy_ against Tensor.copy_: every pair's bytes copied
when the flag is zero, none touched when it is not, for every dtype (NaN
payloads, integers, bools), odd sizes, dense non-contiguous layouts, many
tensors (several CUDA launches) and sizes that take many blocks a tensor."""

import pytest
import torch

import fusetrain  # noqa: F401  (registers the ops)
from fusetrain._ops import gated_copy_

from _test_helpers import DEVICES

SEED = 20261127
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.uint8, torch.int8, torch.bool]


def random_tensor(shape, dtype, device):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, device=device).to(dtype)
        if t.numel() > 2:  # values a select could change: NaN, -0.0, inf
            flat = t.view(-1)
            flat[0], flat[1], flat[-1] = float("nan"), -0.0, float("inf")
        return t
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, device=device, dtype=dtype)


def as_bytes(t):
    """The tensor's values as raw bytes, in memory order."""
    base = t.permute(*torch.argsort(torch.tensor(t.stride()), descending=True).tolist()).contiguous()
    return base.view(-1).view(torch.uint8) if base.dtype != torch.bool else base.view(-1).to(torch.uint8)


def pairs(device, shapes, dtypes, channels_last=False):
    dst, src = [], []
    for shape, dtype in zip(shapes, dtypes):
        d, s = random_tensor(shape, dtype, device), random_tensor(shape, dtype, device)
        if channels_last and len(shape) == 4:
            d, s = d.contiguous(memory_format=torch.channels_last), s.contiguous(memory_format=torch.channels_last)
        dst.append(d)
        src.append(s)
    return dst, src


def check(dst, src, flag, device):
    before = [d.clone() for d in dst]
    gated_copy_(dst, src, torch.tensor(flag, dtype=torch.float32, device=device))
    for i, (d, s, b) in enumerate(zip(dst, src, before)):
        want = b if flag != 0 else s
        assert d.stride() == want.stride()
        assert torch.equal(as_bytes(d), as_bytes(want)), f"pair {i} ({d.dtype}, {tuple(d.shape)}), flag {flag}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [0.0, 1.0, float("nan"), float("inf")])
def test_every_dtype_odd_sizes(device, flag):
    sizes = [(1,), (3,), (7, 5), (1031,), (2, 3, 5, 7), (0,), (4097,)]
    shapes = [sizes[i % len(sizes)] for i in range(len(DTYPES) * 2)]
    dst, src = pairs(device, shapes, DTYPES * 2)
    check(dst, src, flag, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_dense_layouts_many_tensors_and_large_ones(device, flag):
    # 300 pairs: three CUDA launches; channels-last pairs: dense, not contiguous;
    # 3M float32 elements: many blocks a pair, a grid-stride loop.
    shapes = [(2, 3, 4, 5)] * 40 + [(n,) for n in range(1, 261)] + [(3_000_001,)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64] * 101
    dst, src = pairs(device, shapes, dtypes[:len(shapes)], channels_last=True)
    assert not dst[0].is_contiguous()
    check(dst, src, flag, device)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_tensors_and_an_empty_list(device):
    # Views starting one element in: the byte path where 16-byte copies cannot be used.
    base_d = [random_tensor((1000,), dt, device) for dt in (torch.uint8, torch.float16, torch.float32)]
    base_s = [random_tensor((1000,), dt, device) for dt in (torch.uint8, torch.float16, torch.float32)]
    firsts = [b[:1].clone() for b in base_d]
    check([b[1:] for b in base_d], [b[1:] for b in base_s], 0.0, device)
    assert all(torch.equal(as_bytes(b[:1]), as_bytes(f)) for b, f in zip(base_d, firsts)), \
        "an element before a view changed"
    gated_copy_([], [], torch.zeros((), device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_pair_of_one_tensor_is_left_alone(device):
    t = random_tensor((33,), torch.float32, device)
    want = t.clone()
    gated_copy_([t], [t], torch.zeros((), device=device))
    assert torch.equal(as_bytes(t), as_bytes(want))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    op = torch.ops.fusetrain.gated_copy_
    zero, one = torch.zeros((), device=device), torch.ones((), device=device)
    dst, src = pairs(device, [(3, 4), (7,), (1,), (2, 3, 4, 5)], [torch.float32, torch.bfloat16, torch.int64,
                                                                   torch.float16], channels_last=True)
    for flag in (zero, one):
        torch.library.opcheck(op, ([d.clone() for d in dst], src, flag))
    torch.library.opcheck(op, ([], [], zero))


def test_compiles_without_graph_break():
    dst, src = pairs("cpu", [(7,), (3, 5)], [torch.float32, torch.int64])
    flag = torch.zeros(())
    want = [s.clone() for s in src]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(d, s, f):
        gated_copy_(d, s, f)

    fn(dst, src, flag)
    assert all(torch.equal(as_bytes(d), as_bytes(w)) for d, w in zip(dst, want))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_a_clear_error_before_any_copy(device):
    zero = torch.zeros((), device=device)
    a, b = torch.zeros(4, device=device), torch.ones(4, device=device)
    buf = torch.arange(6.0, device=device)
    cases = [
        (([a], [b, b], zero), "2 dst tensors but 3 src"),
        (([a], [b], torch.zeros(2, device=device)), "found_inf must be a float32 tensor with one element"),
        (([a], [b], torch.zeros((), dtype=torch.float64, device=device)), "found_inf must be a float32"),
        (([a], [b.double()], zero), "src\\[1\\] has dtype"),
        (([a], [torch.ones(5, device=device)], zero), "one shape and one layout"),
        (([torch.zeros(2, 3, device=device)], [torch.ones(3, 2, device=device).t()], zero), "one shape and one layout"),
        (([torch.zeros(4, 2, device=device)[:, 0]], [torch.ones(4, 2, device=device)[:, 0]], zero),
         "must be a dense tensor"),
        (([buf[1:5]], [buf[:4]], zero), "overlap in part"),
    ]
    if device != "cpu":
        cases.append((([a], [b.cpu()], zero), "src\\[1\\] on cpu"))
    for args, msg in cases:
        good = torch.full((3,), 7.0, device=device)
        with pytest.raises(ValueError, match=msg):
            gated_copy_([good] + args[0], [torch.zeros(3, device=device)] + args[1], args[2])
        assert torch.equal(good, torch.full((3,), 7.0, device=device)), f"{msg}: changed before the error"
