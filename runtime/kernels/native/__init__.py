"""The packed-weight matmul kernel (``qmatmul.cpp``), compiled for this CPU on first use.

``module()`` builds the C++ source with torch's extension builder (``-O3 -march=native``;
ninja and a C++ compiler are needed once) into ``$HETPLAN_CACHE`` (default
``~/.cache/hetplan``)/kernels/<hash of source, torch version and CPU flags>, and afterwards
imports the cached library directly (no build step, a few milliseconds); concurrent first uses
wait on one build. The source is compiled from its copy inside that directory, so that
checkouts at different paths holding the same source share one build instead of each
rebuilding it over the other's (the build rules name the source's path). It returns None, with the
reason in ``unavailable()``, where the build fails or ``HETPLAN_NATIVE_KERNELS=0``: callers then
use the portable torch path (``hetplan.runtime.kernels.linear``).
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("qmatmul.cpp")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("qint8.h", "qdecode.h", "qdecode_avx2.h", "smallops.h"))
"""Files ``SOURCE`` includes: part of the build key, copied beside it."""
NAME = "hetplan_qmatmul"
BUILD_SCHEME = b"source copied into the build directory; OpenMP"
"""Part of the build directory's key: builds made another way are not reused."""
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
LDFLAGS = ("-fopenmp",)
"""How the kernel is compiled and linked (for this CPU, with OpenMP)."""
_state: dict = {}


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), or the machine name where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine()


def build_dir() -> Path:
    key = hashlib.sha256(b"".join(f.read_bytes() for f in (SOURCE, *HEADERS)) + torch.__version__.encode() + cpu_flags().encode()
                         + BUILD_SCHEME).hexdigest()[:16]
    root = Path(os.environ.get("HETPLAN_CACHE", Path.home() / ".cache" / "hetplan"))
    return root / "kernels" / key


def module():
    """The compiled kernel module, or None (``unavailable()`` says why)."""
    if "module" in _state:
        return _state["module"]
    from hetplan.env import switch
    if not switch("HETPLAN_NATIVE_KERNELS", True):
        _state.update(module=None, why="HETPLAN_NATIVE_KERNELS=0")
        return None
    where = build_dir()
    built = _import(where / f"{NAME}.so")
    if built is not None:
        _state.update(module=built, why=None)
        return built
    from torch.utils import cpp_extension
    where.mkdir(parents=True, exist_ok=True)
    try:
        for original in (*HEADERS, SOURCE):
            _copy(original, where / original.name)
        source = where / SOURCE.name
        mod = cpp_extension.load(name=NAME, sources=[str(source)], build_directory=str(where),
                                 extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)
        _state.update(module=mod, why=None)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path runs instead
        _state.update(module=None, why=f"the native kernel did not build ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    return _state["module"]


def _copy(original: Path, copy: Path) -> None:
    """``original`` to ``copy`` (atomically: a concurrent build never reads half a file)."""
    if not copy.is_file() or copy.read_bytes() != original.read_bytes():
        tmp = copy.with_name(f".{copy.name}.{os.getpid()}")
        tmp.write_bytes(original.read_bytes())
        os.replace(tmp, copy)


def _import(path: Path):
    """The extension module built at ``path``, or None where there is none yet (or it cannot be
    imported: a build in progress, a stale file; ``module`` then builds it)."""
    if not path.is_file():
        return None
    import importlib.machinery
    import importlib.util
    import sys
    if NAME in sys.modules:
        return sys.modules[NAME]
    try:
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
        spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except ImportError:
        return None
    sys.modules[NAME] = mod
    return mod


def unavailable() -> str | None:
    """Why ``module()`` is None (None when it loaded or was not tried)."""
    return _state.get("why")
