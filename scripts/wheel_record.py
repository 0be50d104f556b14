"""The record of how a wheel was built (written by scripts/build-wheel next to
the wheel as <wheel>.json) and the checks made from it (scripts/gpu-check).

    python3 scripts/wheel_record.py snapshot FILE          # the sources as they are before the build
    python3 scripts/wheel_record.py write WHEEL --snapshot FILE --python PY --archs LIST --seconds S [--tests BINARY]
    python3 scripts/wheel_record.py check-fresh WHEEL      # exit 1 when this tree's sources differ
    python3 scripts/wheel_record.py contents WHEEL         # exit 1 when _C, libfusetrain_core, _build_config or LICENSE is missing

Only the standard library: it runs under whatever Python calls it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the wheel is compiled from (the Python package is compared file by file
# with the wheel's copy instead).
NATIVE_SOURCES = ("csrc", "cmake", "CMakeLists.txt", "pyproject.toml", "tests/cpp")
PACKAGE = "python/fusetrain"
REQUIRED_MEMBERS = (r"fusetrain/_C\.cpython-[^/]+\.so", r"fusetrain/libfusetrain_core\.so", r"fusetrain/_build_config\.py",
                    r"fusetrain-[^/]+\.dist-info/licenses/LICENSE")  # the licence travels with the wheel


def record_path(wheel: str) -> str:
    return wheel + ".json"


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def _files(paths) -> list:
    """Tracked and untracked-but-not-ignored files under ``paths``, sorted."""
    out = _git("ls-files", "--cached", "--others", "--exclude-standard", "--", *paths)
    return sorted(p for p in set(out.splitlines()) if os.path.isfile(os.path.join(REPO, p)))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def native_digests() -> dict:
    return {p: _sha256(os.path.join(REPO, p))[:16] for p in _files(NATIVE_SOURCES)}


def snapshot() -> dict:
    """What the build compiles from: commit, uncommitted changes and the native sources' digests."""
    return {"git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "native_sources": native_digests()}


def _tool_version(cmd, pattern: str) -> str:
    """The first line of ``cmd``'s output that matches ``pattern`` ("" when the tool is missing)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return next((ln.strip() for ln in (r.stdout + r.stderr).splitlines() if re.search(pattern, ln)), "")


def _symbol_versions(path: str) -> dict:
    """The newest GLIBC_ and GLIBCXX_ symbol versions a shared object needs (the
    oldest system it loads on)."""
    r = subprocess.run(["objdump", "-T", path], capture_output=True, text=True)
    newest = {}
    for lib, ver in re.findall(r"\b(GLIBC|GLIBCXX)_([0-9.]+)\b", r.stdout):
        key = tuple(int(x) for x in ver.split("."))
        if lib not in newest or key > newest[lib][0]:
            newest[lib] = (key, ver)
    return {lib: v for lib, (_, v) in newest.items()}


def check_contents(wheel: str) -> list:
    """The required members the wheel lacks."""
    names = zipfile.ZipFile(wheel).namelist()
    return [m for m in REQUIRED_MEMBERS if not any(re.fullmatch(m, n) for n in names)]


def write(args) -> int:
    import tempfile

    py_info = json.loads(subprocess.run(
        [args.python, "-c", "import json, sys, platform, torch; print(json.dumps({'python': platform.python_version(), "
         "'python_tag': f'cp{sys.version_info[0]}{sys.version_info[1]}', 'torch': str(torch.__version__), "
         "'torch_cuda': torch.version.cuda}))"], capture_output=True, text=True, check=True).stdout)
    symbols = {}
    with zipfile.ZipFile(args.wheel) as z, tempfile.TemporaryDirectory() as tmp:
        for name in z.namelist():
            if name.endswith(".so"):
                symbols[os.path.basename(name)] = _symbol_versions(z.extract(name, tmp))
    record = {
        "wheel": os.path.basename(args.wheel),
        "sha256": _sha256(args.wheel),
        "bytes": os.path.getsize(args.wheel),
        **py_info,
        "python_executable": args.python,
        "cuda_archs": args.archs or "default list of cmake/FusetrainCuda.cmake",
        "nvcc": _tool_version(["nvcc", "--version"], r"release"),
        "cxx": _tool_version(["c++", "--version"], r"\d+\.\d+"),
        "cmake": _tool_version([os.path.join(os.path.dirname(args.python), "cmake"), "--version"], r"version"),
        "host": f"{platform.system()} {platform.machine()}, glibc {platform.libc_ver()[1]}",
        "needs_symbol_versions": symbols,
        "built_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "build_seconds": round(args.seconds),
    }
    with open(args.snapshot) as f:
        record.update(json.load(f))
    if args.tests:
        record["cpp_tests"] = {"file": os.path.basename(args.tests), "sha256": _sha256(args.tests),
                               "bytes": os.path.getsize(args.tests)}
    with open(record_path(args.wheel), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"[build-wheel] record: {record_path(args.wheel)}")
    return 0


def stale_files(wheel: str) -> list:
    """This tree's files that differ from what the wheel was built from: native
    sources by the record's digests, the Python package by the wheel's copy."""
    with open(record_path(wheel)) as f:
        built = json.load(f)["native_sources"]
    now = native_digests()
    changed = sorted(p for p in set(built) | set(now) if built.get(p) != now.get(p))
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n[len("fusetrain/"):]: n for n in z.namelist()
                    if n.startswith("fusetrain/") and n.endswith(".py") and n != "fusetrain/_build_config.py"}
        tree = {p[len(PACKAGE) + 1:]: p for p in _files([PACKAGE]) if p.endswith(".py")}
        for rel in sorted(set(in_wheel) | set(tree)):
            if rel not in in_wheel or rel not in tree:
                changed.append(tree.get(rel, f"{PACKAGE}/{rel} (only in the wheel)"))
            elif z.read(in_wheel[rel]) != open(os.path.join(REPO, tree[rel]), "rb").read():
                changed.append(tree[rel])
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("wheel")
    w.add_argument("--snapshot", required=True)
    w.add_argument("--python", required=True)
    w.add_argument("--archs", default="")
    w.add_argument("--seconds", type=float, required=True)
    w.add_argument("--tests", default="")
    for name in ("check-fresh", "contents"):
        sub.add_parser(name).add_argument("wheel")
    sub.add_parser("snapshot").add_argument("file")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        return write(args)
    if args.cmd == "snapshot":
        with open(args.file, "w") as f:
            json.dump(snapshot(), f)
        return 0
    if args.cmd == "contents":
        missing = check_contents(args.wheel)
        for m in missing:
            print(f"{args.wheel}: no member matching {m}", file=sys.stderr)
        return 1 if missing else 0
    if not os.path.exists(record_path(args.wheel)):
        print(f"{args.wheel}: no build record {record_path(args.wheel)} (build it with scripts/build-wheel)",
              file=sys.stderr)
        return 1
    changed = stale_files(args.wheel)
    if changed:
        print(f"{args.wheel} was built from other sources than this tree's; rebuild it with scripts/build-wheel. "
              f"Differing files: {', '.join(changed[:20])}{' ...' if len(changed) > 20 else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
