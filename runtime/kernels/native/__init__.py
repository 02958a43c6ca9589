"""The packed-weight matmul kernel (``qmatmul.cpp``), compiled for this CPU on first use.

``module()`` builds the C++ source with torch's extension builder (``-O3 -march=native``;
ninja and a C++ compiler are needed once) into ``$HETPLAN_CACHE`` (default
``~/.cache/hetplan``)/kernels/<hash of source, torch version and CPU flags>, and loads the
cached build afterwards; concurrent first uses wait on one build. It returns None, with the
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
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + cpu_flags().encode()).hexdigest()[:16]
    root = Path(os.environ.get("HETPLAN_CACHE", Path.home() / ".cache" / "hetplan"))
    return root / "kernels" / key


def module():
    """The compiled kernel module, or None (``unavailable()`` says why)."""
    if "module" in _state:
        return _state["module"]
    if os.environ.get("HETPLAN_NATIVE_KERNELS", "1") == "0":
        _state.update(module=None, why="HETPLAN_NATIVE_KERNELS=0")
        return None
    from torch.utils import cpp_extension
    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    try:
        mod = cpp_extension.load(name="hetplan_qmatmul", sources=[str(SOURCE)], build_directory=str(where),
                                 extra_cflags=["-O3", "-march=native", "-ffp-contract=fast"], verbose=False)
        _state.update(module=mod, why=None)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path runs instead
        _state.update(module=None, why=f"the native kernel did not build ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    return _state["module"]


def unavailable() -> str | None:
    """Why ``module()`` is None (None when it loaded or was not tried)."""
    return _state.get("why")
