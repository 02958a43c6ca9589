"""Ctrl-C, as a user sends it to a running command: the process ends with exit 130 (or 2) and
one line, and the file it was to write is left as it was (absent, or its old bytes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def start(code_or_argv, cwd: Path) -> subprocess.Popen:
    argv = [sys.executable, "-c", code_or_argv] if isinstance(code_or_argv, str) else code_or_argv
    # SIGINT as a terminal delivers it: a shell that starts pytest in the background hands its
    # children SIGINT ignored, and Python keeps an inherited SIG_IGN
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(child: subprocess.Popen, text: str, limit_s: float = 120.0) -> list:
    """stderr lines up to the first containing ``text``."""
    lines, t0 = [], time.monotonic()
    while time.monotonic() - t0 < limit_s:
        line = child.stderr.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"never saw {text!r}: {lines}")


def test_a_native_call_that_never_polls_is_still_ended_by_ctrl_c(tmp_path):
    """Inside ``interruptible()`` a call that holds the process in C for minutes (no callback, no
    bytecode) still ends on SIGINT, with exit 130 and the one line."""
    code = ("import hashlib, sys\n"
            "from hetplan import progress\n"
            "with progress.interruptible():\n"
            "    print('ready', file=sys.stderr, flush=True)\n"
            "    hashlib.pbkdf2_hmac('sha256', b'x', b'y', 2**31 - 1)\n")
    child = start(code, tmp_path)
    wait_for(child, "ready")
    child.send_signal(signal.SIGINT)
    try:
        _, err = child.communicate(timeout=60)  # the hash alone would run for many minutes
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("SIGINT did not end the native call")
    assert child.returncode == 130
    assert err.strip().splitlines() == ["hetplan: interrupted; nothing was written"]


@pytest.mark.parametrize("old", [None, b"an older plan\n"], ids=["absent", "existing"])
def test_ctrl_c_during_a_long_compile_leaves_the_target_as_it_was(tmp_path, old):
    routing = tmp_path / "stats.json"
    subprocess.run([sys.executable, "-m", "hetplan.routing_gen", "qwen3-30b-a3b", "--skew", "1.0", "-o",
                    str(routing)], check=True, cwd=ROOT, capture_output=True)
    target = tmp_path / "plan.json"
    if old is not None:
        target.write_bytes(old)
    # a throughput search over batches with a skewed profile: about 20 s of solving on this machine
    child = start([sys.executable, "-m", "hetplan", "compile", "qwen3-30b-a3b", "--hw", "laptop-8g",
                   "--weight-dtype", "q4_k_m", "--routing", str(routing), "--objective", "throughput",
                   "--batch", "64", "--max-nodes", "100000", "-o", str(target)], tmp_path)
    seen = wait_for(child, "solving")
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if not ln.startswith("hetplan: ") or "interrupted" in ln
             or "error" in ln]
    assert child.returncode in (130, 2), (child.returncode, seen, err)
    assert len([ln for ln in lines if "interrupted" in ln or "error" in ln]) == 1, err
    assert "Traceback" not in err
    if old is None:
        assert not target.exists()
    else:
        assert target.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["stats.json"] + ([] if old is None else ["plan.json"]))
