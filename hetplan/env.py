"""The ``HETPLAN_*`` environment variables, read in one place.

A switch is 1 or 0 (also true/false, yes/no, on/off, any case); any other value is a mistake
named with its value, never read as "on" because it is not "0". ``check()`` runs when a command
starts, so a bad value is refused before any work, whichever code path would read it.
"""

from __future__ import annotations

import os
from pathlib import Path

from hetplan.errors import HetplanError

SWITCHES = {
    "HETPLAN_TRACEBACK": "print the traceback of an internal error (default 0)",
    "HETPLAN_NATIVE_KERNELS": "use the native quantised kernels (default 1)",
    "HETPLAN_CPU_16BIT": "decode 16-bit weights with torch's 16-bit GEMV where the CPU has native 16-bit arithmetic "
                         "(default 0: the native kernel upcasting per block, faster at decode)",
    "HETPLAN_CPU_UPCAST": "multiply 16-bit weights at prefill in fp32, a tile upcast at a time, even where the CPU has "
                          "16-bit GEMMs (default 0: only where it has none)",
    "HETPLAN_INT8_PREFILL": "multiply prefill activations in int8 with the native kernel on packed weights (default 1 where AVX-512 VNNI or AVX2 is)",
    "HETPLAN_INT8_DECODE": "multiply decode activations in int8 with the native kernel on packed weights (default 1 where AVX-512 VNNI or AVX2 is)",
    "HETPLAN_HUGE_PAGES": "ask for transparent huge pages under weights and caches in host memory (default 1)",
}
PATHS = {"HETPLAN_CACHE": "the folder native kernels are built into (default ~/.cache/hetplan)"}
COUNTS = {"HETPLAN_JOBS": "processes a compile prices pipeline stages in at once (default: the CPUs it may run on; "
                          "1: this process alone)"}

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str, default: bool) -> bool:
    """The switch ``name`` (``default`` when unset or empty)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise HetplanError(f"environment variable {name}={raw!r}: expected 1 or 0 (or true/false); "
                       f"it switches: {SWITCHES.get(name, name)}; unset it for the default")


def count(name: str, default: int) -> int:
    """The positive whole number ``name`` (``default`` when unset or empty)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise HetplanError(f"environment variable {name}={raw!r}: expected a whole number of at least 1 "
                           f"({COUNTS[name]}); unset it for the default")
    return value


def check() -> None:
    """Refuse a bad value of any ``HETPLAN_*`` variable hetplan reads."""
    for name in SWITCHES:
        switch(name, False)
    for name in COUNTS:
        count(name, 1)
    for name, what in PATHS.items():
        raw = os.environ.get(name)
        if raw is None:
            continue
        p = Path(raw)
        if not raw.strip() or (p.exists() and not p.is_dir()):
            raise HetplanError(f"environment variable {name}={raw!r}: not a folder ({what}); "
                               f"point it at a folder or unset it")
