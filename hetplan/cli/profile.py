"""``hetplan profile``: measure this machine into node.yaml + node.profile.json, or fold a run's
trace into an existing profile (``--from-trace``)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import click
import yaml

from hetplan.cli.app import require_torch
from hetplan.errors import HetplanError
from hetplan.files import writable_target
from hetplan.plan import write_atomic
from hetplan.progress import activity, cancellable, step
from hetplan.units import format_seconds

DEFAULT_BUDGET = "120s"


BUDGET_MAX_S = 24 * 3600.0
"""The longest --budget accepted: a day (a profile needs minutes)."""


def parse_budget(text: str) -> float:
    """``120s``, ``2m``, ``90`` (seconds) -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min)?\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise HetplanError(f"--budget: cannot read {text!r} as a duration (write e.g. 120s or 2m)")
    seconds = float(m.group(1)) * (60.0 if m.group(2) in ("m", "min") else 1.0)
    if seconds > BUDGET_MAX_S:
        raise HetplanError(f"--budget {text}: longer than {BUDGET_MAX_S / 3600:g} hours; a profile needs "
                           f"minutes (the default is {DEFAULT_BUDGET})")
    return seconds


def node_dict(peaks: dict, machine: dict, profile_file: str) -> dict:
    """The node.yaml mapping for measured ``peaks`` (SI values keyed by node.yaml path).

    Measured peaks are what this machine achieves, so every efficiency is 1."""
    def flops(prefix):
        return {k.rsplit(".", 1)[1]: _rate(v, "FLOPS") for k, v in peaks.items() if k.startswith(prefix)}

    node = {"name": f"profiled-{_host()}",
            "cpu": {"name": machine.get("cpu_model", "cpu"), "cores": int(machine.get("cpu_count") or 0),
                    "memory": f"{machine['memory_bytes'] / 2**30:.2f}GiB",
                    "mem_bandwidth": _rate(peaks["cpu.mem_bandwidth"], "B/s"), "flops": flops("cpu.flops.")},
            "gpus": []}
    eff = {"cpu_mem": 1.0, "cpu_flops": 1.0}
    if "gpus[0].mem_bandwidth" in peaks:
        g = machine["gpus"][0]
        node["gpus"] = [{"name": g["name"], "memory": f"{g['memory_bytes'] / 2**30:.2f}GiB",
                         "mem_bandwidth": _rate(peaks["gpus[0].mem_bandwidth"], "B/s"),
                         "flops": flops("gpus[0].flops.")}]
        node["links"] = {d: _rate(peaks[f"links.{d}"], "B/s") for d in ("h2d", "d2h") if f"links.{d}" in peaks}
        eff.update(gpu_mem=1.0, gpu_flops=1.0, link=1.0)
    node["efficiency"] = eff
    node["latency"] = {k.split(".", 1)[1]: float(f"{v:.4g}") for k, v in sorted(peaks.items())
                       if k.startswith("latency.")}
    node["profile"] = profile_file
    return node


def _required(peaks: dict) -> list:
    """The measured values a node.yaml cannot do without (a GPU needs its links too)."""
    need = ["cpu.mem_bandwidth", "cpu.flops.fp32"]
    if any(k.startswith("gpus[0].") for k in peaks):
        need += ["gpus[0].mem_bandwidth", "links.h2d", "links.d2h"]
    return need


def _rate(v: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if v >= scale:
            return f"{v / scale:.4g}{prefix}{unit}"
    return f"{v:.4g}{unit}"


def _in_dtypes(spec, weight_dtypes: tuple) -> tuple:
    """``spec`` in its own weight dtype and in each of ``weight_dtypes`` (once each)."""
    dtypes = dict.fromkeys((spec.weight_dtype,) + tuple(weight_dtypes))
    return tuple(spec if d == spec.weight_dtype else spec.with_dtypes(weight_dtype=d) for d in dtypes)


def _host() -> str:
    import socket
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "machine"


def measure(out: str, budget_s: float, models: tuple, progress=None, started: float | None = None,
            weight_dtypes: tuple = ()):
    """Profile this machine within ``budget_s`` seconds counted from ``started`` (a
    ``time.perf_counter()`` value; now by default) and write ``out`` and its profile table beside
    it; each model's stages are timed in its own dtype and in each of ``weight_dtypes``.
    Refuses (HetplanError) to write impossible values. Returns (ProfileResult, profile path)."""
    from hetplan.dtypes import check_dtype
    from hetplan.frontends.resolve import load_model
    from hetplan.profile.checks import peak_problems, profile_problems

    if weight_dtypes and not models:
        raise HetplanError("--weight-dtype times a --model's stages in that dtype: add --model MODEL")
    for d in weight_dtypes:
        check_dtype(d, "--weight-dtype")
    specs = tuple(s for m in models for s in _in_dtypes(load_model(m), weight_dtypes))
    out_path = Path(out)
    writable_target(out_path, "--out")
    writable_target(out_path.with_name(out_path.stem + ".profile.json"), "--out")
    from hetplan.runtime.profiler import Budget, profile_machine

    out_path = Path(out)
    prof_path = out_path.with_name(out_path.stem + ".profile.json")
    budget = Budget(budget_s, start=started if started is not None else time.perf_counter())
    with step(f"profiling for up to {budget_s:g} s (Ctrl-C stops; nothing is written until the end)",
              long=True), cancellable():
        result = profile_machine(budget, specs, progress=progress)
    missing = [k for k in _required(result.peaks) if k not in result.peaks]
    if missing:
        raise HetplanError(f"refusing to write {out}: --budget {budget_s:g}s was too short to measure "
                           f"{', '.join(missing)}; raise --budget")
    problems = peak_problems(result.peaks, result.machine) + profile_problems(result.table)
    if problems:
        raise HetplanError(f"refusing to write {out}: impossible measured values: " + "; ".join(problems)
                           + "; re-run `hetplan profile` on an idle machine")
    node = node_dict(result.peaks, result.machine, prof_path.name)
    header = (f"# Measured by `hetplan profile` on {node['name']} with {result.table.info['threads']} "
              f"threads, torch {result.table.info['torch']}.\n"
              f"# Peaks are achieved rates (efficiency 1); per-op times are in {prof_path.name}.\n")
    write_atomic(prof_path, result.table.to_json(), option="--out")
    write_atomic(out_path, header + yaml.safe_dump(node, sort_keys=False), option="--out")
    return result, prof_path


@click.command("profile")
@click.option("--out", default="node.yaml", show_default=True,
              help="node.yaml to write; the table goes beside it as NAME.profile.json.")
@click.option("--budget", default=DEFAULT_BUDGET, show_default=True, help="Time the profile may take (120s, 2m).")
@click.option("--model", "models", multiple=True,
              help="Also time every stage of this model (preset, config.json or directory); repeatable.")
@click.option("--weight-dtype", "weight_dtypes", multiple=True,
              help="Also time each --model's stages with its weights in this dtype (q8_0, q4_0, ...: its "
                   "packed kernels); repeatable. The standard grid times every quantised format anyway.")
@click.option("--from-trace", "trace", default=None,
              help="Fold the task times of a `hetplan exec --trace` run into --profile instead of measuring.")
@click.option("--profile", "profile_path", default=None, help="With --from-trace: the node.profile.json to update.")
@click.option("--plan", "plan_path", default=None,
              help="With --from-trace: the plan the trace ran (when the trace does not carry it).")
def command(out, budget, models, weight_dtypes, trace, profile_path, plan_path):
    """Measure this machine (CPU, GPU, links, and the stages of --model) and write a node.yaml
    that `hetplan compile --hw` reads, with a measured per-op table the cost model prefers."""
    started = time.perf_counter()
    if not trace:
        require_torch("profile")
    if trace:
        _fold(trace, profile_path, plan_path)
        return
    if profile_path or plan_path:
        raise HetplanError("--profile and --plan go with --from-trace")
    budget_s = parse_budget(budget)

    def progress(n):
        if sys.stderr.isatty():
            return click.progressbar(length=n, label="profiling", file=sys.stderr, show_pos=True,
                                     item_show_func=lambda s: s or "")
        return _Steps(n)

    result, prof_path = measure(out, budget_s, models, progress=progress, started=started,
                                weight_dtypes=weight_dtypes)
    info, p = result.table.info, result.peaks
    click.echo(f"wrote {out} and {prof_path} in {info['elapsed_s']:.1f} s (budget {budget_s:.0f} s, "
               f"{info['threads']} threads): CPU read {p['cpu.mem_bandwidth'] / 1e9:.1f} GB/s, "
               + ", ".join(f"{k.rsplit('.', 1)[1]} {v / 1e9:.1f} GFLOP/s" for k, v in p.items()
                           if k.startswith("cpu.flops."))
               + f", task overhead {format_seconds(p['latency.cpu_task'])}; "
               f"{sum(len(e.points) for e in result.table.entries.values())} points")
    for s in info["skipped"]:
        click.echo(f"skipped: {s}", err=True)
    load = info.get("load_average_before")
    if load is not None and load >= 1.0:
        click.echo(f"note: the load average was {load:g} when profiling started: other work was using "
                   f"the CPUs, and the times measured include its interference", err=True)
    moved = drift_note(p.get("cpu.mem_bandwidth"), info.get("cpu_read_end_bytes_per_s"))
    if moved:
        click.echo(moved, err=True)


DRIFT_TOLERANCE = 0.2
"""How far the CPU's read bandwidth may move between the start and the end of a profile before
the profile says that the machine's speed changed under it."""


def drift_note(start: float | None, end: float | None) -> str | None:
    """A note when the streaming read measured at the end of the profile differs from the one at
    its start by more than ``DRIFT_TOLERANCE`` (None otherwise, or when either is missing)."""
    if not start or not end or abs(end / start - 1.0) <= DRIFT_TOLERANCE:
        return None
    return (f"note: the CPU's streaming read was {start / 1e9:.1f} GB/s when profiling started and {end / 1e9:.1f} "
            f"GB/s at the end: the machine's speed changed while it was measured (other work on its cores or "
            f"memory, a shared host), so plans priced by this profile may be off by as much; re-run "
            f"`hetplan profile` when the machine is quiet")


class _Steps:
    """Progress of the measurements off a terminal: the step being measured becomes the activity
    that ``hetplan.progress``'s heartbeat repeats (a line every 2 s at most, none for a quick run)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int, current_item: str | None = None) -> None:
        self.done += n
        activity(f"{self.done}/{self.total} {current_item or ''}".rstrip())


def _fold(trace: str, profile_path: str | None, plan_path: str | None) -> None:
    from hetplan.profile.trace import fold_trace_file

    if not profile_path:
        raise HetplanError("--from-trace needs --profile NODE.profile.json (the table to update)")
    n, changed = fold_trace_file(trace, profile_path, plan_path)
    click.echo(f"folded {n} measured task times from {trace} into {profile_path} ({changed} points)")
