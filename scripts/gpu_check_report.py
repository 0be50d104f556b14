"""The report of a scripts/gpu-check run: gpu_check_<device>.json from the
run's log folder, rewritten after every stage so that a run cut short still
leaves one.

    python3 scripts/gpu_check_report.py LOGS [LOGS ...] OUT_DIR [--final]

LOGS holds what gpu-check writes: info.json (device and versions), items.tsv
(one line per item: stage, name, kind, status, rc, seconds, cap, result file)
and <name>.log per item. Counts come from the logs as they are, so an item
cut off by its limit still reports the tests it finished. Only the standard
library: it runs under whatever Python calls it.

Several LOGS folders are the calls of one session on one machine, in the
order they ran (each call's gpu-check.tar.gz unpacked in a folder of its
own: LOGS is its build/gpu-check-logs, and a benchmark's report is found
under that folder's root): one report lists every call's items, and an item
that a later call ran again keeps its earlier entry as <name>_call<N>.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Union

_OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_PYTEST_LINE = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+::\S+)"
                          r"|(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b)")
_PYTEST_SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|skipped|errors?|deselected).*) in [\d.]+s")
_GTEST_LINE = re.compile(r"^\[\s+(OK|FAILED|SKIPPED)\s+\] (\w+(?:/\w+)?\.\w+(?:/\w+)?) \(")
_SANITIZER_SUMMARY = re.compile(r"=+ (ERROR|RACECHECK) SUMMARY: (\d+) (?:errors?|hazards?)")
_SANITIZER_FINDING = re.compile(r"^=+ ((?:Invalid|Race|Uninitialized|Barrier|Program hit|Leaked|Malformed)[^\n]*)")


def pytest_counts(text: str) -> Dict[str, object]:
    """Outcome counts of a ``pytest -v`` log; from the final summary line when
    the run reached it, else from the per-test lines (``complete`` False)."""
    per_test: Dict[str, str] = {}
    names = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error", "XFAIL": "xfailed",
             "XPASS": "xpassed"}
    for line in text.splitlines():
        m = _PYTEST_LINE.match(line)
        if m:
            outcome, node = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            # A test failing in teardown after passing reports twice: the failure wins.
            if per_test.get(node) not in ("failed", "error"):
                per_test[node] = names[outcome]
    counts: Dict[str, object] = {k: 0 for k in _OUTCOMES}
    summary = None
    for line in text.splitlines():
        m = _PYTEST_SUMMARY.match(line)
        if m:
            summary = m.group(1)
    if summary is not None:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary):
            counts["error" if word.startswith("error") else word] = int(n)
    else:
        for outcome in per_test.values():
            counts[outcome] += 1
    counts["complete"] = summary is not None
    counts["failed_tests"] = sorted(n for n, o in per_test.items() if o in ("failed", "error"))
    return counts


def gtest_counts(text: str) -> Dict[str, object]:
    """Outcome counts of a GoogleTest log (one line per finished test)."""
    status: Dict[str, str] = {}
    for line in text.splitlines():
        m = _GTEST_LINE.match(line)
        if m:
            status[m.group(2)] = {"OK": "passed", "FAILED": "failed", "SKIPPED": "skipped"}[m.group(1)]
    counts: Dict[str, object] = {k: sum(1 for v in status.values() if v == k) for k in ("passed", "failed", "skipped")}
    counts["complete"] = bool(re.search(r"^\[==========\] \d+ tests? from .* ran", text, re.M))
    counts["failed_tests"] = sorted(n for n, v in status.items() if v == "failed")
    return counts


def sanitizer_findings(text: str) -> Dict[str, object]:
    """compute-sanitizer's summary (errors or hazards; None when the run did not
    reach it) and the first findings as printed."""
    found = _SANITIZER_SUMMARY.findall(text)
    # One ERROR SUMMARY per sanitized process; racecheck's own summary counts only where none came.
    totals = [int(n) for kind, n in found if kind == "ERROR"] or [int(n) for _, n in found]
    findings = [m.group(1).strip() for m in map(_SANITIZER_FINDING.match, text.splitlines()) if m]
    return {"findings": sum(totals) if totals else None, "first": findings[:10]}


def benchmark_targets(path: str) -> Dict[str, object]:
    """A benchmark report's verdicts (``all_targets_met`` and each target line)."""
    with open(path) as f:
        report = json.load(f)
    targets, met = report.get("targets"), report.get("all_targets_met")
    if met is None and isinstance(targets, list) and targets and all(isinstance(t, dict) and "met" in t for t in targets):
        met = all(t["met"] is not False for t in targets)  # a report that lists its verdicts only
    return {"all_targets_met": met, "targets": targets}


# The lines of an Nsight Compute report a profile item keeps: name, unit, value.
NCU_METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Registers Per Thread",
               "Theoretical Occupancy", "Achieved Occupancy", "Issue Slots Busy", "No Eligible")
NCU_LINE = re.compile(r"^\s+(" + "|".join(re.escape(m) for m in NCU_METRICS) + r")\s{2,}(?:(\S+)\s{2,})?([\d.,]+)\s*$")


def ncu_metrics(text: str) -> Dict[str, str]:
    """The first value of each of NCU_METRICS in an ncu text report, with its unit."""
    found: Dict[str, str] = {}
    for line in text.splitlines():
        m = NCU_LINE.match(line)
        if m and m.group(1) not in found:
            found[m.group(1)] = f"{m.group(3)} {m.group(2) or ''}".strip()
    return found


def ncu_source_hotspots(text: str, top: int = 20) -> List[Dict[str, object]]:
    """The instructions with the most warp-stall samples in an ncu source page
    (``ncu -i REPORT --page source --csv``): address, instruction and share of
    all samples, most first. The header is the first row naming a column
    "...Warp Stall Sampling (All Samples)..." (else "...Sampling..."); rows
    before it (ncu's own lines) are skipped. Empty when there is none."""
    rows = list(csv.reader(io.StringIO(text)))
    for h, header in enumerate(rows):
        sampled = [i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c] or \
                  [i for i, c in enumerate(header) if "Sampling" in c]
        if sampled:
            break
    else:
        return []
    col = sampled[0]
    named = {c.strip().lower(): i for i, c in enumerate(header)}
    where = named.get("address", 0)
    what = next((named[k] for k in ("source", "sass", "instruction") if k in named), None)
    found = []
    for row in rows[h + 1:]:
        try:
            samples = float(row[col].replace(",", ""))
        except (IndexError, ValueError):
            continue
        found.append({"address": row[where] if where < len(row) else "",
                      "instruction": row[what].strip() if what is not None and what < len(row) else "",
                      "samples": samples})
    total = sum(f["samples"] for f in found)
    found.sort(key=lambda f: -f["samples"])
    for f in found:
        f["share_pct"] = round(100.0 * f["samples"] / total, 2) if total else 0.0
    return found[:top]


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def device_slug(name: Optional[str]) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; no GPU -> ``"cpu"``."""
    if not name:
        return "cpu"
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "_", name)).lower()


def _result_path(logs: str, result: str) -> str:
    """A benchmark's report as items.tsv names it: relative to the run's root, which is this folder or, for
    a call's unpacked tarball, the folder two levels above its logs."""
    if not result or os.path.isabs(result):
        return result
    unpacked = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(logs))), result)
    return unpacked if os.path.exists(unpacked) else result


def _call_items(logs: str) -> List[Dict[str, object]]:
    """The items of one call's logs, in the order they ran."""
    info_path = os.path.join(logs, "info.json")
    started = os.path.getmtime(info_path) if os.path.exists(info_path) else 0.0
    items: List[Dict[str, object]] = []
    for line in _read(os.path.join(logs, "items.tsv")).splitlines():
        stage, name, kind, status, rc, seconds, cap, result = (line.split("\t") + [""] * 8)[:8]
        item: Dict[str, object] = {"stage": stage, "name": name, "kind": kind, "status": status,
                                   "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                                   "seconds": int(seconds) if seconds.isdigit() else None,
                                   "limit_s": int(cap) if cap.isdigit() else None}
        text = _read(os.path.join(logs, f"{name}.log"))
        if status.startswith("SKIPPED"):
            pass
        elif kind == "pytest":
            item["tests"] = pytest_counts(text)
        elif kind == "gtest":
            item["tests"] = gtest_counts(text)
        elif kind.startswith("sanitize"):
            item["tests"] = pytest_counts(text) if kind.endswith("pytest") else gtest_counts(text)
            item["sanitizer"] = sanitizer_findings(text)
        elif kind == "profile":
            item["profile"] = ncu_metrics(text)
            # A profile saved per instruction (ncu_update_int8_source) leaves <name>.csv beside its log.
            source = _read(os.path.join(logs, f"{name}.csv"))
            if source:
                item["hotspots"] = ncu_source_hotspots(source)
        elif kind == "bench":
            item["result_file"] = result
            # Only a report this run wrote (an item cut off leaves an older one in place).
            path = _result_path(logs, result)
            if path and os.path.exists(path) and os.path.getmtime(path) >= started:
                item.update(benchmark_targets(path))
        items.append(item)
    return items


def build_report(logs: Union[str, Sequence[str]], final: bool) -> Dict[str, object]:
    calls = [logs] if isinstance(logs, str) else list(logs)
    infos = [json.loads(t) for t in (_read(os.path.join(c, "info.json")) for c in calls) if t]
    info = infos[0] if infos else {}
    items: List[Dict[str, object]] = []
    for n, call in enumerate(calls, 1):
        for item in _call_items(call):
            if len(calls) > 1:
                item["call"] = n
            items.append(item)
    # An item that a later call ran again: its earlier try keeps its own name and leaves the totals.
    last = {item["name"]: k for k, item in enumerate(items)}
    latest = []
    for k, item in enumerate(items):
        if last[item["name"]] != k:
            item["name"] = f"{item['name']}_call{item.get('call', 1)}"
            item["superseded"] = True
        else:
            latest.append(item)
    totals = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for item in latest:
        if item["kind"] in ("pytest", "gtest") and "tests" in item:
            for k in totals:
                totals[k] += int(item["tests"].get(k, 0))
    sanitized = [i["sanitizer"]["findings"] for i in latest if "sanitizer" in i]  # the items that ran
    return {
        "device": info.get("device"),
        "device_slug": device_slug(info.get("device")),
        "rehearsal": any(i.get("rehearsal", False) for i in infos),
        "versions": info.get("versions", {}),
        "wheel": info.get("wheel"),
        "started_utc": info.get("started_utc"),
        "calls": len(calls),
        "complete": final,
        "stages": items,
        "tests": totals,
        "sanitizer_findings": (sum(f for f in sanitized if f is not None)
                               if sanitized and all(f is not None for f in sanitized) else None),
        "benchmarks_all_targets_met": {i["name"]: i.get("all_targets_met") for i in items if i["kind"] == "bench"},
    }


def summary_lines(report: Dict[str, object]) -> List[str]:
    lines = [f"device: {report['device'] or 'no GPU'}{' (rehearsal)' if report['rehearsal'] else ''}"]
    for item in report["stages"]:
        extra = ""
        if "tests" in item:
            t = item["tests"]
            extra = (f"passed {t['passed']} failed {t['failed'] + t.get('error', 0)} skipped {t['skipped']}"
                     f"{'' if t['complete'] else ' (cut off)'}")
        if "sanitizer" in item:
            extra += f"; sanitizer findings {item['sanitizer']['findings']}"
        if item["kind"] == "bench":
            extra = f"targets met: {item.get('all_targets_met')}"
        if item.get("profile"):
            extra = "; ".join(f"{k} {v}" for k, v in item["profile"].items())
        if item.get("hotspots"):
            extra += "; most stalled: " + ", ".join(f"{h['address']} {h['instruction']} {h['share_pct']}%"
                                                    for h in item["hotspots"][:5])
        lines.append(f"{item['stage']:9s} {item['name']:26s} {item['status']:18s} {item['seconds'] or 0:4d}s  {extra}")
    t = report["tests"]
    lines.append(f"tests: passed {t['passed']} failed {t['failed'] + t['error']} skipped {t['skipped']}; "
                 f"sanitizer findings: {report['sanitizer_findings']}")
    return lines


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    final = "--final" in args
    args = [a for a in args if a != "--final"]
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    logs, out_dir = args[:-1], args[-1]
    missing = [d for d in logs if not os.path.isdir(d)]
    if missing or not os.path.isdir(out_dir):
        print(f"gpu_check_report.py: no such folder: {', '.join(missing or [out_dir])} "
              "(LOGS: a run's build/gpu-check-logs; OUT_DIR: where the report goes)", file=sys.stderr)
        return 2
    report = build_report(logs, final)
    path = os.path.join(out_dir, f"gpu_check_{report['device_slug']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    if final:
        print("\n".join(summary_lines(report)))
        print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
