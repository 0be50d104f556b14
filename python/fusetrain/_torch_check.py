"""Loads the native core (``_C``) only next to the torch it was built against.

The core links against libtorch's C++ API, which changes between torch
releases, so a core built for one torch fails inside another with an undefined
symbol or a crash. The build writes the torch version it compiled against into
the generated module ``fusetrain._build_config`` (CMakeLists.txt installs it
next to ``_C``, in regular and editable installs alike). ``load_native()``
compares it with the running torch before loading ``_C`` and explains a
mismatch. A build older than that file has no record: the check is skipped."""

from __future__ import annotations

import importlib
import re
from typing import Optional, Tuple

__all__ = ["built_torch_version", "release", "versions_match", "mismatch_message", "check_torch", "load_native"]

_RELEASE = re.compile(r"^\s*(\d+)\.(\d+)\.(\d+)")


def release(version: str) -> Optional[Tuple[int, int, int]]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``; None when ``version`` does not
    start with major.minor.patch."""
    m = _RELEASE.match(str(version))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def versions_match(built: str, running: str) -> bool:
    """True when the two torch versions agree in major.minor.patch (local tags
    such as ``+cu130`` are ignored); versions without that form must be equal."""
    b, r = release(built), release(running)
    if b is None or r is None:
        return str(built).strip() == str(running).strip()
    return b == r


def mismatch_message(built: str, running: str, cause: Optional[BaseException] = None) -> str:
    """The ImportError text for a core built against torch ``built`` loaded
    into torch ``running``."""
    lines = [
        f"fusetrain's native extension (fusetrain._C, libfusetrain_core) was built against torch {built}, "
        f"but the installed torch is {running}.",
        "The extension uses torch's C++ API, which differs between torch builds, so it must be built against "
        "the torch it runs with. Either:",
        "  - rebuild fusetrain against this torch: `bash scripts/setup` in a source checkout, or "
        "`pip install --no-build-isolation --force-reinstall --no-deps .` (add `-e` and "
        "`-Cbuild-dir=build/py` for an editable install), or",
        f"  - install the torch it was built against: `pip install torch=={built.split('+')[0]}`.",
    ]
    if cause is not None:
        lines.append(f"Loading the extension failed with: {type(cause).__name__}: {cause}")
    return "\n".join(lines)


def built_torch_version() -> Optional[str]:
    """The torch version the native core was built against, or None for a
    build that did not record it."""
    try:
        config = importlib.import_module("fusetrain._build_config")
    except ModuleNotFoundError:
        return None
    version = getattr(config, "TORCH_VERSION", "")
    return str(version) or None


def _running_torch_version() -> str:
    import torch

    return str(torch.__version__)


def check_torch(built: Optional[str] = None, running: Optional[str] = None) -> None:
    """Raises ImportError naming both versions when the core was built against
    another torch release than the running one; does nothing when the build
    did not record its torch."""
    built = built_torch_version() if built is None else built
    if built is None:
        return
    running = _running_torch_version() if running is None else running
    if not versions_match(built, running):
        raise ImportError(mismatch_message(built, running))


def load_native():
    """Imports and returns ``fusetrain._C`` after ``check_torch()``. When loading
    fails (ImportError, OSError) and the recorded torch version differs from the
    running one in any way (a local tag such as ``+cpu`` vs ``+cu130`` too),
    the error names both versions; otherwise the original error propagates."""
    check_torch()
    try:
        return importlib.import_module("fusetrain._C")
    except (ImportError, OSError) as exc:
        built, running = built_torch_version(), _running_torch_version()
        if built is not None and built.strip() != running.strip():
            raise ImportError(mismatch_message(built, running, cause=exc)) from exc
        raise
