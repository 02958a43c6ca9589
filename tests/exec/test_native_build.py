"""The native kernel's build cache: built once per (source, torch, CPU), then imported without
running the builder, whatever path the source was checked out at."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetplan.runtime.kernels import native

PROBE = """
import sys
import torch.utils.cpp_extension as builder
def refuse(*a, **k):
    raise RuntimeError("the builder ran")
builder.load = refuse
from hetplan.runtime.kernels import native
mod = native.module()
print("module" if mod is not None else native.unavailable())
"""


@pytest.fixture(scope="module")
def built():
    if native.module() is None:
        pytest.skip(f"no native kernel here: {native.unavailable()}")
    return native.build_dir()


def test_a_built_kernel_is_imported_without_running_the_builder(built):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module"


def test_the_build_compiles_the_sources_copy_in_the_cache(built):
    assert (built / native.SOURCE.name).read_bytes() == native.SOURCE.read_bytes()
    rules = (built / "build.ninja").read_text()
    assert str(built / native.SOURCE.name) in rules and str(native.SOURCE) not in rules


def test_a_library_that_does_not_import_is_not_used(tmp_path):
    # a cache directory holding a file that is not a library (a build that died while linking):
    # ``module`` must build rather than fail, so the import answers None (in a fresh process,
    # where no kernel module is loaded yet)
    fake = tmp_path / f"{native.NAME}.so"
    fake.write_bytes(b"not an ELF file")
    code = ("from pathlib import Path; from hetplan.runtime.kernels import native; "
            f"print(native._import(Path({str(fake)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_the_kernels_parallel_regions_run_on_torchs_threads(built):
    """Built without OpenMP, ``at::parallel_for`` in the library runs its range on the calling
    thread alone: every kernel would use one core whatever ``torch.set_num_threads`` says."""
    import torch
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert native.module().parallel_threads(1024) == n
    finally:
        torch.set_num_threads(before)
