"""Fold the measured task times of a run (``hetplan exec --trace``) into a profile table.

A trace's measured lanes (``hetplan.plan.timeline``: one process per (measured, phase), one thread
per resource, one complete event per task whose ``args.id`` is the plan's task id) give every
compute task's duration. The plan that ran rebuilds the same stages the planner priced (its
model and workload), so each duration lands at a (device, op, dtype, shape, x) of the table.
The durations that land on one point (every layer, every decode step) become one point with
source ``trace``: their median and interquartile range. It replaces whatever was measured at
that x, because what the runtime did end to end is what later plans should be priced with;
other points stay.

Pure: reads JSON and plans, knows nothing about torch or how the run was executed.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.files import read_json
from hetplan.graph import PHASES, block_graph
from hetplan.plan import RESOURCES, Plan, load_plan, write_atomic
from hetplan.profile.table import Entry, Point, ProfileTable, coordinate, load_profile, shape_key, table_dtype
from hetplan.plan.timeline import SOURCES, trace_pid

COMPUTE = ("cpu", "gpu")


def measured_durations(trace: dict, source: str = "trace.json") -> dict:
    """(phase, task id, resource) -> [seconds, ...] of the measured compute tasks in ``trace``."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise HetplanError(f"{source}: not a Chrome trace (no traceEvents list)")
    lanes = {trace_pid("measured", ph): ph for ph in PHASES}
    out = {}
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("pid") not in lanes:
            continue
        tid = e.get("tid")
        resource = RESOURCES[tid - 1] if isinstance(tid, int) and 1 <= tid <= len(RESOURCES) else None
        task_id = (e.get("args") or {}).get("id")
        if resource not in COMPUTE or not task_id:
            continue
        out.setdefault((lanes[e["pid"]], task_id, resource), []).append(float(e.get("dur", 0.0)) * 1e-6)
    if not out:
        raise HetplanError(f"{source}: no measured compute tasks (expected the {SOURCES[1]} lanes "
                           f"written by `hetplan exec --trace`)")
    return out


def fold_trace(table: ProfileTable, plan: Plan, durations: dict) -> tuple[ProfileTable, int, int]:
    """``table`` with the measured ``durations`` of a run of ``plan`` folded in
    -> (new table, task times used, points written)."""
    spec = plan.model
    dtype = table_dtype(spec)
    if dtype is None:
        raise HetplanError(f"the plan's weights are {spec.weight_dtype}: profile tables cover fp32, bf16 "
                           f"and fp16 only, so its trace cannot be folded in")
    if spec.extra.get("source") == "onnx":
        from hetplan.frontends.onnx.graph import onnx_block_graph
        graph = onnx_block_graph(spec, plan.workload)
    else:
        graph = block_graph(spec, plan.workload)
    stages = {(ph, st.id): st for ph in PHASES for st in graph.stages[ph]}
    grouped, used = {}, 0
    for (phase, task_id, device), secs in durations.items():
        st = stages.get((phase, task_id))
        if st is None:
            continue
        w = st.work
        key = (device, w.op, dtype, shape_key(w.op, spec))
        x = coordinate(w.op, w, spec)
        grouped.setdefault((key, x), (w, []))[1].extend(s for s in secs if s > 0)
        used += len(secs)
    if not used:
        raise HetplanError("none of the trace's tasks is a stage of the plan: pass the plan the trace "
                           "was recorded from (--plan)")
    for (key, x), (w, secs) in sorted(grouped.items()):
        if not secs:
            continue
        spread = statistics.quantiles(secs, n=4) if len(secs) > 1 else [0.0, 0.0, 0.0]
        p = Point(x=x, seconds=statistics.median(secs), spread_s=spread[2] - spread[0], repeats=len(secs),
                  flops=w.flops, bytes=w.bytes, source="trace")
        entry = table.entries.get(key) or Entry(*key, points=())
        table = table.with_entry(entry.with_point(p))
    return table, used, sum(1 for _, (_, s) in grouped.items() if s)


def fold_trace_file(trace_path: str, profile_path: str, plan_path: str | None) -> tuple[int, int]:
    """Fold ``trace_path`` (a run of ``plan_path``) into ``profile_path`` in place
    -> (task times used, points written). The result is validated before it is written."""
    from hetplan.profile.checks import profile_problems

    if not plan_path:
        raise HetplanError("--from-trace needs --plan PLAN.json: the plan the trace was recorded from")
    p = Path(trace_path)
    trace = read_json(p, f"trace file (write one with `hetplan exec PLAN --trace {p}`)")
    table = load_profile(profile_path)
    folded, used, points = fold_trace(table, load_plan(plan_path), measured_durations(trace, str(p)))
    problems = profile_problems(folded)
    if problems:
        raise HetplanError(f"{p}: refusing to fold impossible task times into {profile_path}: "
                           + "; ".join(problems))
    write_atomic(profile_path, folded.to_json(), option="--profile")
    return used, points
