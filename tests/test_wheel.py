"""The built wheel ships every subpackage: build it, unpack it, import every module from it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

IMPORT_ALL = """
import importlib, json, sys
root = sys.argv[1]
names = json.loads(sys.argv[2])
where = {}
for name in names:
    where[name] = importlib.import_module(name).__file__
print(json.dumps(where))
"""


def _source_modules() -> set[str]:
    """Every module of the source tree, named as installed (``solvers/`` and ``runtime/`` ship as
    ``hetplan.solvers`` and ``hetplan.runtime``)."""
    roots = {"hetplan": REPO / "hetplan", "hetplan.solvers": REPO / "solvers", "hetplan.runtime": REPO / "runtime"}
    names = set()
    for pkg, root in roots.items():
        for f in root.rglob("*.py"):
            parts = f.relative_to(root).with_suffix("").parts
            names.add(".".join((pkg, *parts[:-1])) if parts[-1] == "__init__" else ".".join((pkg, *parts)))
    return names


def _clean_tree(dst: Path) -> Path:
    """The files a fresh clone would hold (tracked, and untracked but not ignored), copied to
    ``dst``: a build in the working tree could pick up stale ``build/`` or ``*.egg-info`` files."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for rel in listed:
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)
    return dst


def test_wheel_holds_and_imports_every_module(tmp_path):
    src = _clean_tree(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("hetplan-*.whl")
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    in_wheel = {".".join(p.with_suffix("").parts[:-1] if p.stem == "__init__" else p.with_suffix("").parts)
                for p in (Path(n) for n in zipfile.ZipFile(wheel).namelist()) if p.suffix == ".py"}
    expected = _source_modules()
    assert expected - in_wheel == set(), "modules missing from the wheel"
    names = sorted(n for n in expected if n != "hetplan.__main__")
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(unpacked), json.dumps(names)], cwd=tmp_path,
                         env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin"},
                         check=True, capture_output=True, text=True).stdout
    where = json.loads(out)
    outside = {n: f for n, f in where.items() if not Path(f).resolve().is_relative_to(unpacked.resolve())}
    assert outside == {}, "modules imported from outside the wheel"


def test_every_pure_module_imports_first_in_a_fresh_interpreter():
    """Import order must not matter: each torch-free module is imported first in its own process
    (an import cycle shows only when a cycle's later module is imported first)."""
    pure = sorted(n for n in _source_modules() if not n.startswith("hetplan.runtime") and n != "hetplan.__main__")
    code = "import sys, importlib\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    failed = {}
    for name in pure:
        res = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, cwd=REPO)
        if res.returncode:
            failed[name] = res.stderr.strip().splitlines()[-1]
    assert failed == {}


def test_layout_keeps_concerns_in_folders():
    """The layout rules: ``hetplan/`` holds at most 25 modules directly, and no source folder
    holds three or more modules sharing a name prefix (a concern with several files gets a
    folder); pytest's ``test_`` is a convention, not a prefix, so tests count by the word after it."""
    assert len(list((REPO / "hetplan").glob("*.py"))) <= 25
    crowded = {}
    for root in ("hetplan", "solvers", "runtime", "tests", "bench"):
        for folder in [REPO / root, *(p for p in (REPO / root).rglob("*") if p.is_dir())]:
            prefixes = {}
            for f in folder.glob("*.py"):
                words = f.stem.removeprefix("test_").split("_")
                if len(words) > 1:
                    prefixes.setdefault(words[0], []).append(f.name)
            crowded.update({f"{folder.relative_to(REPO)}/{p}_*": n for p, n in prefixes.items() if len(n) >= 3})
    assert crowded == {}
