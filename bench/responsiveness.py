"""Ctrl-C and silence, side by side in one run: a long compile, a long ``hetplan profile`` and
``hetplan exec`` of a small model in a long prefill, each as a child process.

For each: SIGINT is sent once the long part is under way (``--wait`` seconds after its marker
line on stderr), and the run records the seconds from SIGINT to exit (target: <= 1 s), the exit
code (130, or 2 with one line), whether each output target is intact (pre-filled with known
bytes: still those bytes, no temporary file left beside it; a target that did not exist stays
absent), the time to the first stderr line, and the longest silence on stderr between the first
line and the SIGINT (target: <= ~1.5 s; the Python and torch imports before the first line are
reported apart, since no progress can be printed before them).

    python bench/responsiveness.py                 # all three
    python bench/responsiveness.py --only exec --wait 8
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

OLD = b"old contents, must survive\n"


@dataclass
class Scenario:
    name: str
    argv: list
    marker: str
    """The stderr text that says the long part has started."""
    targets: list
    """Files the command would write: pre-filled with OLD where ``prefill`` says so."""
    prefill: bool = True
    setup: list = field(default_factory=list)
    """Commands run first (not timed)."""


def hetplan(*args) -> list:
    return [sys.executable, "-m", "hetplan", *map(str, args)]


def scenarios(tmp: Path) -> list:
    stats = tmp / "qwen3-30b.routing.json"
    make_stats = [sys.executable, "-m", "hetplan.routing_gen", "qwen3-30b-a3b", "--skew", "1.0",
                  "-o", str(stats)]
    exec_plan = tmp / "llama-1b.plan.json"
    return [
        Scenario("compile (per-block MoE MILPs: qwen3-30b-a3b, skewed routing, laptop-8g, throughput search "
                 "up to batch 64)",
                 hetplan("compile", "qwen3-30b-a3b", "--hw", "laptop-8g", "--weight-dtype", "q4_k_m",
                         "--routing", stats, "--objective", "throughput", "--batch", "64", "--max-nodes", "100000",
                         "-o", tmp / "compile.plan.json"),
                 marker="solving", targets=[tmp / "compile.plan.json"], setup=[make_stats]),
        Scenario("profile (--budget 10m)",
                 hetplan("profile", "--budget", "10m", "--out", tmp / "node.yaml", "--model", "llama-3.2-1b"),
                 marker="", targets=[tmp / "node.yaml", tmp / "node.profile.json"], prefill=False),
        Scenario("exec (llama-3.2-1b bf16, random weights, 1024-token prefill, GPU emulated on the CPU)",
                 hetplan("exec", exec_plan, "--weights", "random", "--gen-len", "4", "--trace",
                         tmp / "exec.trace.json"),
                 marker="prefill", targets=[tmp / "exec.trace.json"],
                 setup=[hetplan("compile", "llama-3.2-1b", "--hw", "laptop-8g", "--weight-dtype", "bf16",
                                "--prompt-len", "1024", "--gen-len", "4", "-o", exec_plan)]),
    ]


def run_one(s: Scenario, wait_s: float, limit_s: float) -> dict:
    for cmd in s.setup:
        subprocess.run(cmd, check=True, capture_output=True)
    for t in s.targets:
        if s.prefill:
            t.write_bytes(OLD)
        else:
            t.unlink(missing_ok=True)
    lines: list = []
    t0 = time.monotonic()
    child = subprocess.Popen(s.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def read():
        for raw in child.stderr:
            # a terminal-style progress line ends in \r: each update counts as a line
            for part in raw.decode(errors="replace").replace("\r", "\n").splitlines():
                if part.strip():
                    lines.append((time.monotonic(), part.strip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = None
    while child.poll() is None and time.monotonic() - t0 < limit_s:
        if started is None and any(s.marker in text for _, text in lines):
            started = time.monotonic()
        if started is not None and time.monotonic() - started >= wait_s:
            break
        time.sleep(0.05)
    if child.poll() is not None:
        return {"name": s.name, "error": f"finished (rc {child.returncode}) before it was interrupted",
                "tail": [t for _, t in lines[-3:]]}
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    try:
        rc = child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        rc = "killed after 60 s"
    exited = time.monotonic()
    reader.join(timeout=5)
    before = [t for t, _ in lines if t <= sent]
    gaps = [b - a for a, b in zip(before, before[1:])] + ([sent - before[-1]] if before else [])
    after = [text for t, text in lines if t > sent]
    said = next((t - sent for t, text in lines if t > sent and "interrupted" in text), None)
    intact = []
    for t in s.targets:
        if s.prefill:
            intact.append(t.exists() and t.read_bytes() == OLD)
        else:
            intact.append(not t.exists())
    leftovers = [p.name for p in s.targets[0].parent.iterdir() if p.name.startswith(".")]
    return {"name": s.name, "sigint_to_exit_s": exited - sent, "rc": rc, "after": after, "said_s": said,
            "first_line_s": (before[0] - t0) if before else None, "longest_silence_s": max(gaps, default=None),
            "lines_before": len(before), "ran_s": sent - t0, "targets_ok": all(intact), "leftovers": leftovers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("compile", "profile", "exec"), default=None)
    ap.add_argument("--wait", type=float, default=10.0, help="seconds into the long part before SIGINT")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds to wait for the marker at most")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetplan-responsiveness-"))
    rows = []
    try:
        for s in scenarios(tmp):
            if args.only and not s.name.startswith(args.only):
                continue
            r = run_one(s, args.wait, args.limit)
            rows.append(r)
            print(r, file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, `python bench/responsiveness.py --wait {args.wait:g}`")
    print("| run | ran before SIGINT | first stderr line | longest silence after it | SIGINT -> exit | exit code "
          "| stderr after SIGINT | targets intact | targets |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['error']} | | | | | {r['tail']} | | |")
            continue
        ok_exit = "yes" if r["sigint_to_exit_s"] <= 1.0 else "**NO**"
        ok_quiet = "yes" if (r["longest_silence_s"] or 0) <= 1.5 else "**NO**"
        print(f"| {r['name']} | {r['ran_s']:.1f} s | {r['first_line_s']:.1f} s | {r['longest_silence_s']:.2f} s "
              f"({ok_quiet}) | {r['sigint_to_exit_s']:.2f} s ({ok_exit}) | {r['rc']} | {' / '.join(r['after'])} "
              f"| {'yes' if r['targets_ok'] and not r['leftovers'] else '**NO** ' + str(r['leftovers'])} "
              f"| {'pre-filled' if r['name'].startswith(('compile', 'exec')) else 'absent before'} |")


if __name__ == "__main__":
    main()
