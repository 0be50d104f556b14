"""Graph breaks and training-step time of a BN-heavy CNN under torch.compile
with torch's SyncBatchNorm path vs fusetrain.nn.SyncBatchNorm, in 2 processes.

Transport: 2 gloo processes on the CPU, or NCCL on 2 GPUs when more than one
is present. Each process trains the same CNN (6 conv + BN + ReLU blocks) on its
own batch with SGD; the step (forward, backward, optimizer step) is compiled.

Variants:
  torch      torch.nn.SyncBatchNorm (on GPUs). torch's layer refuses CPU
             tensors in a distributed run and its statistics kernels are
             CUDA-only, so on the CPU this variant is the same algorithm written
             with torch ops and eager c10d collectives (all_gather of mean,
             invstd and count; all_reduce of the gradient sums), as
             torch/nn/modules/_functions.py does it.
  fusetrain  fusetrain.nn.SyncBatchNorm (fused statistics kernels, functional
             collectives, one collective per layer each way).

Graph breaks are counted with torch._dynamo.explain on the forward+loss; step
times are medians over rounds of interleaved variants. Target: 0 graph breaks
for fusetrain and a step time at least as fast as the torch path.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

import _common as C  # noqa: E402
import fusetrain  # noqa: E402

VARIANTS = ("torch", "fusetrain")


class _TorchAlgorithmSyncBN(torch.autograd.Function):
    """torch's SyncBatchNorm algorithm with torch ops and eager c10d (CPU stand-in)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, world):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        var, mean = torch.var_mean(x.float(), dims, correction=0)
        count = torch.full((1,), x.numel() // c, dtype=torch.float32)
        local = torch.cat([mean, torch.rsqrt(var + eps), count])
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        allst = torch.stack(parts)
        means, invstds, counts = allst[:, :c], allst[:, c:2 * c], allst[:, 2 * c:]
        n = counts.sum()
        g_mean = (means * counts).sum(0) / n
        vars_ = 1.0 / invstds.square() - eps
        g_var = ((vars_ + (means - g_mean).square()) * counts).sum(0) / n
        invstd = torch.rsqrt(g_var + eps)
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x - g_mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(x, weight, g_mean, invstd, n)
        y = xhat * weight.view(shape) + bias.view(shape)
        # No ``.to()`` when the dtype already matches: with torch 2.11 a no-op
        # ``.to()`` on the value returned here makes the compiled graph feed the
        # backward a zero gradient (every parameter below it gets grad 0).
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, n = ctx.saved_tensors
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        xmu = x - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_w, grad_b = sum_dy_xmu * invstd, sum_dy.clone()
        both = torch.cat([sum_dy, sum_dy_xmu])
        dist.all_reduce(both)
        k1 = (both[:c] / n).view(shape)
        k2 = (both[c:] / n * invstd.square()).view(shape)
        dx = (dy - k1 - xmu * k2) * (invstd * weight).view(shape)
        return dx, grad_w, grad_b, None, None


class TorchAlgorithmSyncBN(nn.BatchNorm2d):
    def forward(self, x):
        return _TorchAlgorithmSyncBN.apply(x, self.weight, self.bias, self.eps, dist.get_world_size())


def make_model(width: int, blocks: int = 6) -> nn.Sequential:
    layers, cin = [], 3
    for _ in range(blocks):
        layers += [nn.Conv2d(cin, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def convert(model: nn.Module, variant: str, device: torch.device) -> nn.Module:
    if variant == "fusetrain":
        return fusetrain.nn.convert_sync_batchnorm(model)
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            new = TorchAlgorithmSyncBN(child.num_features)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
    return model


def _worker(rank, world, cfg, result_path):
    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(cfg["threads_per_rank"])
    dist.init_process_group(cfg["backend"], init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=world)
    timer = C.Timer(dev)
    out = {}
    try:
        torch.manual_seed(0)
        base = make_model(cfg["width"]).to(dev)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(cfg["batch"], 3, cfg["size"], cfg["size"], generator=g).to(dev)
        steps = {}
        for variant in VARIANTS:
            model = convert(make_model(cfg["width"]).to(dev), variant, dev)
            model.load_state_dict(base.state_dict())
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

            def loss_fn(inp, model=model):
                return model(inp).square().mean()

            explained = torch._dynamo.explain(loss_fn)(x)
            torch._dynamo.reset()
            compiled = torch.compile(loss_fn, backend=cfg["compile_backend"])

            def step(compiled=compiled, opt=opt):
                loss = compiled(x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            t0 = time.perf_counter()
            loss = compiled(x)
            loss.backward()
            # Norm of the first step's gradients: both variants must agree.
            grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])).item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            first = loss.item()
            compile_s = time.perf_counter() - t0
            for _ in range(cfg["warmup"]):
                step()
            steps[variant] = step
            out[variant] = {"graph_breaks": explained.graph_break_count, "graphs": explained.graph_count,
                            "break_reasons": [str(r.reason)[:200] for r in explained.break_reasons][:5],
                            "first_step_s_incl_compile": compile_s, "loss_first_step": first,
                            "grad_norm_first_step": grad_norm, "times_ms": []}
        for r in range(cfg["repeats"]):
            for variant in C.rotated(VARIANTS, r):
                dist.barrier()
                out[variant]["times_ms"].append(timer.per_step_ms(steps[variant], cfg["steps"]))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)


def main(argv=None):
    ap = C.make_parser(__doc__)
    ap.add_argument("--width", type=int, default=None, help="channels of every conv (default 32; quick 8)")
    ap.add_argument("--batch", type=int, default=None, help="images per rank (default 16; quick 4)")
    ap.add_argument("--size", type=int, default=None, help="image side (default 32; quick 12)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed round (default 10; quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="steps after the first (default 3; quick 1)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; quick aot_eager)")
    args, device = C.parse(ap, argv, "syncbn", "tiny sizes and the aot_eager backend, for the smoke test")
    quick = args.quick
    C.fill_defaults(args, {"width": 8 if quick else 32, "batch": 4 if quick else 16, "size": 12 if quick else 32,
                           "steps": 2 if quick else 10, "repeats": 2 if quick else 5, "warmup": 1 if quick else 3,
                           "compile_backend": "aot_eager" if quick else "inductor"})
    t_start = time.time()
    world = 2
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        print("syncbn: fewer than 2 GPUs; running 2 gloo processes on the CPU instead")
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    meta = C.run_header("syncbn", device, with_loadavg=True)
    cfg = {"device": device.type, "backend": backend, "world_size": world, "width": args.width,
           "batch_per_rank": args.batch, "batch": args.batch, "size": args.size, "steps": args.steps,
           "repeats": args.repeats, "warmup": args.warmup, "compile_backend": args.compile_backend, "quick": quick,
           "blocks": 6, "threads_per_rank": max(1, (os.cpu_count() or 2) // world), "port": _free_port()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        # A fresh inductor cache for the run (unless one is chosen): its keys do
        # not cover custom ops' layout tags, so graphs cached before a change of
        # them would be reused; both variants compile cold.
        own_cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
        if own_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor_cache")
        try:
            mp.spawn(_worker, args=(world, cfg, path), nprocs=world, join=True)
        finally:
            if own_cache:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        with open(path) as f:
            res = json.load(f)
    for v in VARIANTS:
        res[v].update(C.summary(res[v]["times_ms"]))
    print(C.device_line(meta))
    print(f"{world} processes ({backend}), CNN of {cfg['blocks']} conv+BN blocks, width {args.width}, "
          f"batch {args.batch}x3x{args.size}x{args.size} per rank, backend {args.compile_backend}")
    torch_label = "torch.nn.SyncBatchNorm" if device.type == "cuda" else "torch SyncBN algorithm, eager c10d"
    C.print_header_row(f"{'variant':<44} {'graph breaks':>12} {'step median ms':>15} {'step min ms':>12}")
    for v, label in (("torch", torch_label), ("fusetrain", "fusetrain.nn.SyncBatchNorm")):
        r = res[v]
        print(f"{v + ' (' + label + ')':<44} {r['graph_breaks']:>12} {r['median_ms']:>15.3f} {r['min_ms']:>12.3f}")
    print("first-step gradient norm: " + ", ".join(f"{v} {res[v]['grad_norm_first_step']:.6g}" for v in VARIANTS))
    ratio = res["torch"]["median_ms"] / res["fusetrain"]["median_ms"]
    print(f"step time torch / fusetrain: {ratio:.3f}x")
    targets = [
        {"name": "fusetrain graph breaks", "value": res["fusetrain"]["graph_breaks"], "threshold": 0, "op": "==",
         "met": res["fusetrain"]["graph_breaks"] == 0, "applies": True},
        {"name": "step time torch / fusetrain", "value": ratio, "threshold": 1.0, "op": ">=", "met": ratio >= 1.0,
         "applies": not quick},
    ]
    C.print_target(device.type, None, "fusetrain graph breaks", str(res["fusetrain"]["graph_breaks"]), "==", "0",
                   C.verdict(targets[0]["met"]))
    C.print_target(device.type, None, "step time torch / fusetrain", f"{ratio:.3f}", ">=", "1.0",
                   C.verdict(targets[1]["met"], targets[1]["applies"]), "" if not quick else "quick run: not judged")
    cfg.pop("port")
    report = dict(meta)
    report.update({"config": cfg, "torch_variant": torch_label, "results": res,
                   "ratios": {"step_torch_over_fusetrain": ratio}, "targets": targets,
                   "all_targets_met": all(t["met"] for t in targets if t["applies"]),
                   "elapsed_s": time.time() - t_start})
    out = C.out_path(args, "syncbn", device.type)
    C.write_report(report, out)
    try:
        _chart(os.path.splitext(out)[0] + ".png", res, torch_label, meta, cfg)
    except ImportError:
        print("matplotlib is not installed; no chart written")
    return report


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chart(path, res, torch_label, meta, cfg):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"torch\n({torch_label})", "fusetrain.nn.SyncBatchNorm"]
    vals = [res["torch"]["median_ms"], res["fusetrain"]["median_ms"]]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.bar(range(2), vals, color=["tab:gray", "tab:blue"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f} ms\n{res[VARIANTS[i]]['graph_breaks']} graph breaks", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(2))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("compiled training step, median ms")
    ax.set_title(f"SyncBatchNorm, {cfg['world_size']} x {cfg['backend']} on {meta['device_kind']}, "
                 f"torch {meta['torch_version']}", fontsize=9)
    ax.set_ylim(0, max(vals) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
