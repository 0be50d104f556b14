"""What the benchmark scripts share: the flags every one of them has, the run's
header (device, versions, threads, load), interleaved timing, median/min
statistics, the verdict lines of the targets and the JSON report.

The scripts run as ``python benchmarks/<name>.py``, which puts this folder on
``sys.path``; a script loaded by its file path (as the smoke tests do) adds it
itself before importing this module.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

import fusetrain

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---------------------------------------------------------------- command line

def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` (the rest shown as
    written), with ``--device``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    return ap


def parse(ap: argparse.ArgumentParser, argv: Optional[Sequence[str]], benchmark: str,
          quick_help: str) -> Tuple[argparse.Namespace, torch.device]:
    """Add ``--quick`` and ``--out`` (the report goes to
    benchmarks/results/<benchmark>_<cpu|cuda>.json by default), parse ``argv``
    and resolve ``--device``: cuda if available when not given, an error if
    cuda is asked for but absent."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default=None,
                    help=f"JSON output path (default benchmarks/results/{benchmark}_<cpu|cuda>.json)")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda requested but torch.cuda.is_available() is False")
    return args, torch.device(args.device)


def fill_defaults(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """Set each of ``defaults`` on ``args`` where the flag was not given (is None)."""
    for k, val in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, val)


def csv_list(text: str) -> List[str]:
    """The non-empty items of a comma-separated flag value."""
    return [s.strip() for s in text.split(",") if s.strip()]


def choose(ap: argparse.ArgumentParser, flag: str, text: str, choices: Sequence[str], what: str) -> List[str]:
    """The items of a comma-separated ``flag``, each one of ``choices``, in the given order."""
    wanted = csv_list(text)
    unknown = [s for s in wanted if s not in choices]
    if unknown or not wanted:
        ap.error(f"{flag}: unknown {what}(s) {unknown}; choose from {list(choices)}")
    return wanted


def out_path(args: argparse.Namespace, benchmark: str, device_kind: str) -> str:
    return args.out or os.path.join(RESULTS_DIR, f"{benchmark}_{device_kind}.json")


# ---------------------------------------------------------------- the run's header

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> Optional[List[float]]:
    """The 1, 5 and 15 minute load averages, or None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_header(benchmark: str, device: torch.device, with_loadavg: bool = False) -> Dict[str, Any]:
    """The first keys of a report: the benchmark, the device, the versions, the
    thread count and ATen's CPU capability, (with ``with_loadavg``, the load
    average as ``loadavg_start``) and the time of the run."""
    meta: Dict[str, Any] = {
        "benchmark": benchmark,
        "device_kind": device.type,
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "fusetrain_version": fusetrain.__version__,
        "fusetrain_build": fusetrain.build_info(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "num_threads": torch.get_num_threads(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
    }
    if with_loadavg:
        meta["loadavg_start"] = loadavg()
    meta["timestamp_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return meta


def device_line(meta: Mapping[str, Any], cpu_capability: bool = False) -> str:
    """``device: <kind> (<name>), torch <version>, fusetrain build <build>`` from a header."""
    cap = f" (ATen CPU capability {meta['aten_cpu_capability']})" if cpu_capability else ""
    return (f"device: {meta['device_kind']} ({meta['device_name']}), torch {meta['torch_version']}{cap}, "
            f"fusetrain build {meta['fusetrain_build']}")


# ---------------------------------------------------------------- timing and statistics

class Timer:
    """CUDA events on GPU (read after a sync, no host sync between the marks),
    time.perf_counter() on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (on GPU, after a sync past ``b``)."""
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def per_step_ms(self, fn: Callable[[], Any], steps: int) -> float:
        """Time per call of ``steps`` consecutive calls of ``fn``."""
        self.sync()
        start = self.mark()
        for _ in range(steps):
            fn()
        end = self.mark()
        if self.cuda:
            end.synchronize()
        return self.ms(start, end) / steps


def rotated(items: Sequence[Any], r: int) -> List[Any]:
    """``items`` started at position ``r`` (mod its length): the order of the
    ``r``-th round of interleaved variants."""
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def summary(times_ms: List[float]) -> Dict[str, Any]:
    """The times, their median and their minimum (ms)."""
    return {"times_ms": times_ms, "median_ms": statistics.median(times_ms), "min_ms": min(times_ms)}


# ---------------------------------------------------------------- output

def print_header_row(hdr: str) -> None:
    """A table's header line and a rule as long."""
    print(hdr)
    print("-" * len(hdr))


def verdict(met: Optional[bool], applies: bool = True) -> str:
    """MET / NOT MET; N/A when there is no value; in parentheses, lower case,
    for a target that does not apply to this device."""
    if met is None:
        return "N/A"
    if applies:
        return "MET" if met else "NOT MET"
    return "(met)" if met else "(not met)"


def print_target(device_kind: str, scope: Optional[str], name: str, value: str, op: str, threshold: str,
                 result: str, note: str = "") -> None:
    """``TARGET [<device>] [<scope>] <name>: <value> (target <op> <threshold>): <result> (<note>)``;
    no ``[<scope>]`` when ``scope`` is None, no note when it is empty."""
    where = f" [{scope}]" if scope is not None else ""
    note = f" ({note})" if note else ""
    print(f"TARGET [{device_kind}]{where} {name}: {value} (target {op} {threshold}): {result}{note}")


def write_report(report: Mapping[str, Any], path: str, quiet: bool = False) -> None:
    """Write ``report`` as JSON to ``path`` atomically (a temporary file, then a rename) and say so
    (unless ``quiet``: a partial report rewritten as a run goes on)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path} ({report['elapsed_s']:.0f} s)")


def write_partial_report(meta: Dict[str, Any], path: str, png: str, targets: List[Dict[str, Any]], t0: float,
                         final: bool, **fields: Any) -> None:
    """The report of the rows run so far, rewritten after each row (``complete`` once ``final``), so that
    a run cut off by a time limit keeps what it finished."""
    meta["loadavg_end"] = loadavg()
    report = dict(meta, **fields, targets=targets, png=os.path.basename(png),
                  all_targets_met=all(t["met"] for t in targets if t["applies"]),
                  elapsed_s=time.perf_counter() - t0, complete=final)
    write_report(report, path, quiet=not final)


# ---- the seed's MNIST loops (shared by seed_mnist_amp.py and trainer_overhead.py)


def seed_train(data_loader, model, optimizer, criterion, num_epochs: int, device: torch.device, epoch_start,
               epoch_end) -> None:
    """The seed's ``train()``, statement for statement, but for the epoch clock:
    ``epoch_start()`` returns a token that ``epoch_end(epoch, losses, token)``
    receives when the epoch's batches are done (each benchmark's own clock)."""
    for epoch in range(num_epochs):
        token = epoch_start()
        losses = []
        for img, label in data_loader:
            img = img.to(device)
            label = label.to(device)
            optimizer.zero_grad()
            prediction = model(img)
            loss = criterion(prediction, label)
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
        epoch_end(epoch, losses, token)


def seed_optimized_train(data_loader, model, optimizer, criterion, num_epochs: int, device: torch.device,
                         amp_dtype: torch.dtype, epoch_start, epoch_end) -> None:
    """The seed's ``optimized_train()`` (``torch.amp.GradScaler`` is the current
    name of its ``torch.cuda.amp.GradScaler()``); epoch clock as in
    :func:`seed_train`."""
    scaler = torch.amp.GradScaler(device.type)
    for epoch in range(num_epochs):
        token = epoch_start()
        losses = []
        for img, label in data_loader:
            img = img.to(device)
            label = label.to(device)
            optimizer.zero_grad()
            with torch.amp.autocast(device_type=device.type, dtype=amp_dtype):
                prediction = model(img)
                loss = criterion(prediction, label)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        epoch_end(epoch, losses, token)
