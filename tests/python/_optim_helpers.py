"""Helpers of the optimizer test modules (test_fused_adam.py, test_fused_sgd.py,
test_fused_lion.py): parameter and gradient makers, the float32 CPU reference
copies, and comparisons of params, state and snapshots. ``from _optim_helpers
import ...`` (pytest puts tests/python on sys.path)."""

import torch

LOW = [torch.float16, torch.bfloat16]
SHAPES = [(1,), (7,), (13, 17), (1031,), (3, 5, 7)]
STEPS = 100

# fp32 after 100 steps on O(1) params: measured max |diff| about 2.4e-7 (a few
# ulps from different FMA contraction); 1e-6 leaves room for the CUDA kernels.
F32 = dict(rtol=1e-6, atol=1e-6)


def f32(x: float) -> float:
    """``x`` rounded to float32, as the fused ops see a float32 lr tensor."""
    return float(torch.tensor(x, dtype=torch.float32))


def make_params(device, dtypes=(torch.float32,), shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, device=device).to(dtypes[i % len(dtypes)]))
            for i, s in enumerate(shapes)]


def ref_copies(params):
    """fp32 CPU copies for the torch reference."""
    return [torch.nn.Parameter(p.detach().to("cpu", torch.float32).clone()) for p in params]


def new_grads(params, grad_dtype=None, scale=1.0):
    return [(torch.randn(p.shape, device=p.device) * scale).to(grad_dtype or p.dtype) for p in params]


def assign(params, ref_params, grads):
    for p, r, g in zip(params, ref_params, grads):
        if g is not None and g.dtype != p.dtype:
            p.grad_dtype = None  # allow a gradient dtype different from the param's
        p.grad = g
        if r is not None:
            r.grad = None if g is None else g.to("cpu", torch.float32)  # the reference uses grad.float()


@torch.no_grad()
def round_to(ref_params, dtypes):
    """Rounds each reference param to its dtype (``dtypes``: one per param, or one for all)."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(ref_params)
    for r, dt in zip(ref_params, dtypes):
        r.copy_(r.to(dt).float())


def cpu32(t):
    return t.detach().to("cpu", torch.float32)


def assert_params_close(params, ref_params, **tol):
    for i, (p, r) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(cpu32(p), cpu32(r), **tol, msg=lambda m: f"param {i}: {m}")


def assert_low_precision_equal(actual, expected, dtype):
    """``expected`` holds the reference's values already rounded to ``dtype``."""
    a = torch.cat([cpu32(x).reshape(-1) for x in actual])
    e = torch.cat([cpu32(x).reshape(-1) for x in expected])
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a, e, rtol=2 * eps, atol=1e-5)
    frac = (a == e).float().mean().item()
    assert frac >= 0.99, f"only {frac:.4f} of the elements are bit-equal to the rounded reference"


def snapshot(opt, extra=()):
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            out[f"param {gi}.{pi}"] = p.detach().clone()
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor):
                    out[f"state {gi}.{pi}.{k}"] = v.clone()
    for i, t in enumerate(extra):
        out[f"extra {i}"] = t.clone()
    return out


def assert_snapshot_equal(before, after):
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype, k
        assert torch.equal(before[k], after[k]), f"{k} changed"
