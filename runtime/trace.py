"""Measured task times as a Chrome/Perfetto trace, beside the plan's predicted one.

Uses the plan's own trace writer (``hetplan.plan.timeline``): one process per (source, phase), one
thread per resource, one event per task named by its kind and block. The measured decode lane
holds every decode step back to back, at the times they ran; the predicted one holds the plan's
single step. Also the achieved bandwidth of weight loads. Knows nothing about how tasks ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.plan import Plan
from hetplan.plan.timeline import plan_trace_events, task_trace_events, trace_document


@dataclass(frozen=True)
class MeasuredTask:
    """A task as it ran (the fields the trace writer reads)."""
    id: str
    resource: str
    block: str
    kind: str
    start_s: float
    end_s: float
    bytes: float = 0.0


def measured_tasks(program, timings, offset_s: float) -> list[MeasuredTask]:
    """``timings`` (executor ``Timing``s of one run of ``program``) shifted by ``offset_s``."""
    out = []
    for tm in timings:
        t = program.ops[tm.index].task
        out.append(MeasuredTask(t.id, t.resource, t.block, t.kind, offset_s + tm.start_s, offset_s + tm.end_s,
                                t.bytes))
    return out


def trace(plan: Plan, measured: dict) -> dict:
    """One trace document: the plan's predicted phases and ``measured`` (phase -> [MeasuredTask])."""
    return trace_document(plan_trace_events(plan), task_trace_events(measured, "measured"))


def load_bytes_per_s(tasks: list[MeasuredTask]) -> float | None:
    """Bytes moved by ``load`` tasks divided by the time they took: sum(bytes) / sum(duration)."""
    loads = [t for t in tasks if t.kind == "load" and t.end_s > t.start_s]
    if not loads:
        return None
    return sum(t.bytes for t in loads) / sum(t.end_s - t.start_s for t in loads)
