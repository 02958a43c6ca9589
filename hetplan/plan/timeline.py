"""Pictures and traces of a plan's timeline: a Gantt chart (SVG or PNG) and Chrome/Perfetto JSON.

Reads the scheduled task lists of a plan (``PhaseSchedule.tasks``: resource, kind, start and end
times) and nothing else. The trace writer takes any tasks with those fields, so the runtime
writes its measured traces with the same functions and the two can be opened side by side.
Knows nothing about how the times were computed or measured.
"""

from __future__ import annotations

import io
import json
import math
from html import escape
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import RESOURCES, Plan, write_atomic
from hetplan.units import format_seconds

SOURCES = ("predicted", "measured")
"""Where a trace's times come from; each (source, phase) pair is its own trace process."""

KIND_COLORS = {
    "embed": "#8c564b", "attn_in": "#1f77b4", "attn_core": "#17becf", "attn_out": "#aec7e8",
    "mlp": "#2ca02c", "moe": "#98df8a", "moe_route": "#bcbd22", "moe_experts": "#dbdb8d",
    "moe_cold": "#c49c94", "moe_merge": "#9edae5", "head": "#9467bd",
    "load": "#ff7f0e", "act_up": "#e377c2", "act_down": "#f7b6d2", "kv_down": "#d62728",
}
"""Fill colour per task kind (stages greens/blues, transfers warm colours)."""
_OTHER_COLOR = "#7f7f7f"


def legend(panels) -> list:
    """(kind, colour) for the task kinds that occur in ``panels``, in KIND_COLORS order (a kind
    without a colour of its own last, as ``other``)."""
    kinds = {k for _, _, rows in panels for _, tasks in rows for _, _, k, _ in tasks}
    shown = [(k, c) for k, c in KIND_COLORS.items() if k in kinds]
    return shown + ([("other", _OTHER_COLOR)] if kinds - set(KIND_COLORS) else [])


# -- Chrome / Perfetto trace -----------------------------------------------------------------

def trace_pid(source: str, phase: str) -> int:
    """Process id of a (source, phase) pair: predicted prefill 1, predicted decode 2,
    measured prefill 3, measured decode 4."""
    if source not in SOURCES or phase not in PHASES:
        raise ValueError(f"unknown trace lane {source!r}/{phase!r}")
    return SOURCES.index(source) * len(PHASES) + PHASES.index(phase) + 1


def _tid(resource: str) -> int:
    return RESOURCES.index(resource) + 1 if resource in RESOURCES else len(RESOURCES) + 1


def task_trace_events(tasks_by_phase: dict, source: str = "predicted") -> list:
    """Trace events for tasks grouped by phase: one process per phase, one thread per resource,
    one complete (``ph: X``) event per task, times in microseconds.

    A task is anything with ``id``, ``resource``, ``block``, ``kind``, ``start_s``, ``end_s``
    (``bytes`` and ``flops`` are copied into ``args`` when present)."""
    events = []
    for phase in PHASES:
        tasks = list(tasks_by_phase.get(phase, ()))
        if not tasks:
            continue
        pid = trace_pid(source, phase)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{source} {phase}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for resource in sorted({t.resource for t in tasks}, key=_tid):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _tid(resource),
                           "args": {"name": resource}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": _tid(resource),
                           "args": {"sort_index": _tid(resource)}})
        for t in tasks:
            args = {"id": t.id, "block": t.block}
            for key in ("bytes", "flops"):
                if getattr(t, key, None):
                    args[key] = getattr(t, key)
            events.append({"ph": "X", "name": f"{t.kind} {t.block}", "cat": t.kind, "pid": pid,
                           "tid": _tid(t.resource), "ts": t.start_s * 1e6,
                           "dur": max(0.0, t.end_s - t.start_s) * 1e6, "args": args})
    return events


def plan_trace_events(plan: Plan) -> dict:
    """The plan's predicted schedule as a Chrome/Perfetto trace document (``traceEvents``)."""
    tasks = {ph: plan.schedule[ph].tasks for ph in PHASES if ph in plan.schedule}
    return {"traceEvents": task_trace_events(tasks, "predicted"), "displayTimeUnit": "ms",
            "otherData": {"model": plan.model.name, "hardware": plan.hardware.name,
                          "strategy": plan.solver.get("strategy")}}


def trace_document(predicted_events, measured_events=None) -> dict:
    """One trace holding a predicted and a measured timeline side by side.

    Each argument is a trace document (``{"traceEvents": [...]}``) or a list of events, as
    written by ``task_trace_events`` with ``source`` ``predicted`` and ``measured``; their
    process ids differ, so the viewer shows them as separate, aligned process groups."""
    def events(x):
        if x is None:
            return []
        return list(x["traceEvents"] if isinstance(x, dict) else x)

    pred, meas = events(predicted_events), events(measured_events)
    clash = {e["pid"] for e in pred} & {e["pid"] for e in meas}
    if clash:
        raise ValueError(f"predicted and measured traces share process ids {sorted(clash)}; write the "
                         f"measured one with source='measured'")
    return {"traceEvents": pred + meas, "displayTimeUnit": "ms"}


def write_trace(plan: Plan, path: str | Path) -> None:
    write_atomic(path, json.dumps(plan_trace_events(plan), sort_keys=True) + "\n", option="--trace")


# -- Gantt chart ---------------------------------------------------------------------------

def gantt_rows(plan: Plan) -> list:
    """Per phase: (phase, makespan_s, [(resource, [(start_s, end_s, kind, label), ...]), ...]),
    one row per resource the phase uses, in the vocabulary's resource order."""
    panels = []
    for phase in PHASES:
        sched = plan.schedule.get(phase)
        if sched is None or not sched.tasks:
            continue
        rows = {}
        for t in sched.tasks:
            rows.setdefault(t.resource, []).append((t.start_s, t.end_s, t.kind, t.id))
        ordered = [(r, sorted(rows[r])) for r in sorted(rows, key=_tid)]
        panels.append((phase, sched.makespan_s, ordered))
    return panels


def nice_ticks(span_s: float, target: int = 8) -> list:
    """Tick positions 0, step, 2 step, ... <= span_s with step 1, 2 or 5 times a power of ten."""
    if span_s <= 0:
        return [0.0]
    raw = span_s / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(span_s / step + 1e-9) + 1)]


def tick_label(t_s: float, span_s: float) -> str:
    """A tick's time in the unit that suits the whole axis: s, ms or us (``0.5 s``, ``20 ms``)."""
    if t_s == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if span_s >= scale:
            return f"{t_s / scale:.4g} {unit}"
    return f"{t_s / 1e-6:.4g} us"


_W, _LEFT, _RIGHT, _ROW, _GAP, _TITLE, _AXIS = 1200, 90, 20, 22, 4, 26, 30


def render_svg(plan: Plan) -> str:
    """A self-contained SVG Gantt chart: a panel per phase (its own time axis), a row per
    resource, a rectangle per task coloured by kind with a hover title."""
    panels = gantt_rows(plan)
    plot_w = _W - _LEFT - _RIGHT
    out, y = [], 30
    out.append(f'<text x="{_LEFT}" y="18" font-size="14" font-weight="bold">'
               f'{escape(plan.model.name)} on {escape(plan.hardware.name)} '
               f'({escape(str(plan.solver.get("strategy")))})</text>')
    for phase, span_s, rows in panels:
        scale = plot_w / span_s if span_s > 0 else 0.0
        out.append(f'<text x="{_LEFT}" y="{y + 16}" font-size="13">{phase}: {format_seconds(span_s)}</text>')
        y += _TITLE
        top = y
        for resource, tasks in rows:
            out.append(f'<text x="{_LEFT - 6}" y="{y + _ROW * 0.7:.1f}" font-size="12" '
                       f'text-anchor="end">{resource}</text>')
            out.append(f'<rect x="{_LEFT}" y="{y}" width="{plot_w}" height="{_ROW}" fill="#f4f4f4"/>')
            for start_s, end_s, kind, label in tasks:
                x, w = _LEFT + start_s * scale, max(0.5, (end_s - start_s) * scale)
                out.append(f'<rect x="{x:.2f}" y="{y + 1}" width="{w:.2f}" height="{_ROW - 2}" '
                           f'fill="{KIND_COLORS.get(kind, _OTHER_COLOR)}"><title>{escape(label)}: '
                           f'{format_seconds(start_s)} + {format_seconds(end_s - start_s)}</title></rect>')
            y += _ROW + _GAP
        for tick in nice_ticks(span_s):
            x = _LEFT + tick * scale
            out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{y + 2}" stroke="#bbb" '
                       f'stroke-width="0.5"/>')
            out.append(f'<text x="{x:.2f}" y="{y + 14}" font-size="10" text-anchor="middle">'
                       f'{tick_label(tick, span_s)}</text>')
        y += _AXIS
    x = _LEFT
    for kind, color in legend(panels):
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}" font-size="11">{kind}</text>')
        x += 16 + 8 * len(kind) + 14
    height = y + 24
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
            f'viewBox="0 0 {_W} {height}" font-family="sans-serif">\n'
            f'<rect width="{_W}" height="{height}" fill="white"/>\n' + "\n".join(out) + "\n</svg>\n")


def render_png(plan: Plan, path: str | Path) -> None:
    """The same chart drawn with matplotlib (an optional dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise HetplanError(f"--timeline {path}: PNG output needs matplotlib; `pip install matplotlib` "
                           f"or write an .svg instead") from None
    panels = gantt_rows(plan)
    heights = [max(1, len(rows)) for _, _, rows in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.2 + 0.45 * sum(heights) + 0.6 * len(panels)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (phase, span_s, rows) in zip(axes[:, 0], panels):
        for i, (resource, tasks) in enumerate(rows):
            ax.broken_barh([(s, e - s) for s, e, _, _ in tasks], (i - 0.4, 0.8),
                           facecolors=[KIND_COLORS.get(k, _OTHER_COLOR) for _, _, k, _ in tasks])
        ax.set_yticks(range(len(rows)), [r for r, _ in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0, span_s)
        ax.set_xlabel("seconds")
        ax.set_title(f"{phase}: {format_seconds(span_s)}", loc="left", fontsize=10)
    fig.suptitle(f"{plan.model.name} on {plan.hardware.name} ({plan.solver.get('strategy')})")
    shown = legend(panels)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in shown],
               loc="lower center", ncol=max(1, len(shown)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue(), option="--timeline")


def write_timeline(plan: Plan, path: str | Path) -> None:
    """Draw the plan's predicted schedule to ``path``: ``.svg`` (no dependencies) or ``.png``."""
    suffix = Path(path).suffix.lower()
    if suffix == ".svg":
        write_atomic(path, render_svg(plan), option="--timeline")
    elif suffix == ".png":
        render_png(plan, path)
    else:
        raise HetplanError(f"--timeline {path}: unknown picture format {suffix or '(none)'!r}; "
                           f"name the file .svg or .png")
