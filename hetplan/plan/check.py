"""Plan regression checks: recompile a plan from its recorded inputs and compare.

A checked-in plan records the ``CompileRequest`` that produced it (``inputs.cli_args``).
Recompiling it with today's code and presets and diffing the two catches regressions in the
cost model, the solver or the presets: a predicted latency that got worse by more than a
tolerance, memory over budget (the compiler then refuses the plan and says what is missing),
or a different placement. A plan over several devices is first replayed as recorded (each
stage's plan, each link, the pipeline's predictions: ``simulate_pipeline``), so that a plan
edited by hand fails before anything is recompiled.
Knows nothing about how plans are solved; it calls ``hetplan.compiler``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.plan import Plan, load_plan, write_atomic
from hetplan.units import format_seconds

LATENCY_KEYS = ("ttft_s", "tpot_s", "latency_s")
"""Predicted times that must not grow by more than the tolerance."""
PLACEMENT_KEYS = ("weights", "kv", "experts_on_gpu")
MAX_DIFF_LINES = 12
"""Placement differences listed before the rest are counted."""


@dataclass(frozen=True)
class CheckResult:
    path: str
    failures: tuple
    """One readable line per regression; empty when the plan passes."""
    notes: tuple
    """Differences that do not fail the plan: improvements beyond the tolerance, allowed or
    time-limited placement changes."""
    summary: str
    updated: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures


def plan_paths(args, strict: bool = True) -> list:
    """Expand PLAN.json files and directories (their ``*.json``, sorted) into plan paths. With
    ``strict=False`` a path that is missing (or a directory without plans) is kept, so that the
    caller reports it beside the other plans instead of stopping at it."""
    paths = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            found = sorted(q for q in p.glob("*.json") if not q.name.startswith("."))
            if not found and strict:
                raise HetplanError(f"{p}: no *.json plans in this directory")
            paths += found or ([] if strict else [p])
        elif p.is_file() or not strict:
            paths.append(p)
        else:
            raise HetplanError(f"{p}: no such plan file or directory")
    if not paths:
        raise HetplanError("no plans given: pass PLAN.json files or a directory of them")
    return paths


def request_of(plan: Plan, source: str) -> CompileRequest:
    """The CompileRequest recorded in ``plan.inputs.cli_args``."""
    args = plan.inputs.get("cli_args")
    if not isinstance(args, dict):
        raise HetplanError(f"{source}: the plan records no inputs.cli_args, so it cannot be recompiled; "
                           f"compile it with `hetplan compile`")
    known = {f.name for f in dataclasses.fields(CompileRequest)
             if f.init and f.name not in ("notes", "dump_lp", "replicas")}
    unknown = set(args) - known
    if unknown:
        raise HetplanError(f"{source}: inputs.cli_args has unknown keys {sorted(unknown)}; accepted: "
                           f"{sorted(known)}")
    try:
        req = CompileRequest(**args)
    except TypeError as e:
        raise HetplanError(f"{source}: inputs.cli_args is malformed ({e}); recompile it with `hetplan compile`") from None
    return _relative_to_plan(req, Path(source).parent)


def _relative_to_plan(req: CompileRequest, folder: Path) -> CompileRequest:
    """Resolve a recorded relative ``--hw`` path (and MODEL path, when it does not exist from here)
    against the plan's own directory, so ``check`` works from any directory; presets, absolute
    paths and paths that exist from the working directory are kept."""
    from hetplan.presets.nodes import NODE_PRESETS

    changes = {}
    for key in ("hw", "model"):
        value = getattr(req, key)
        if not isinstance(value, str):
            raise HetplanError(f"inputs.cli_args.{key}: expected a string, got {value!r}; recompile the plan")
        if key == "hw" and value in NODE_PRESETS:
            continue
        here, there = Path(value), folder / value
        if not here.is_absolute() and not here.exists() and there.exists():
            changes[key] = str(there)
    return dataclasses.replace(req, **changes) if changes else req


def latency_diffs(old: Plan, new: Plan, tolerance: float) -> tuple:
    """(failures, notes): a time worse than ``old * (1 + tolerance)`` fails, better than
    ``old * (1 - tolerance)`` is noted; for the throughput objective tokens/s is checked too."""
    failures, notes = [], []
    for key in LATENCY_KEYS:
        a, b = old.predicted[key], new.predicted[key]
        change = (b - a) / a if a else 0.0
        line = f"{key}: {format_seconds(a)} -> {format_seconds(b)} ({100 * change:+.2f}%)"
        if b > a * (1 + tolerance):
            failures.append(f"{line}, worse than the {100 * tolerance:g}% tolerance")
        elif b < a * (1 - tolerance):
            notes.append(f"{line}, improved")
    if old.workload.objective == "throughput":
        a, b = old.predicted["throughput_tokens_per_s"], new.predicted["throughput_tokens_per_s"]
        if b < a * (1 - tolerance):
            failures.append(f"throughput_tokens_per_s: {a:.4g} -> {b:.4g} ({100 * (b - a) / a:+.2f}%), "
                            f"worse than the {100 * tolerance:g}% tolerance")
    return failures, notes


def placement_diffs(old: Plan, new: Plan) -> list:
    """One line per block whose weights, exec per phase, kv or experts_on_gpu differ, plus
    changes of staging depth, chosen batch and weight dtype."""
    lines = []
    for key, a, b in (("staging depth", old.staging["depth"], new.staging["depth"]),
                      ("batch", old.workload.batch, new.workload.batch),
                      ("weight dtype", old.model.weight_dtype, new.model.weight_dtype)):
        if a != b:
            lines.append(f"{key}: {a} -> {b}")
    before = {p["block"]: p for p in old.placement}
    after = {p["block"]: p for p in new.placement}
    for name in [p["block"] for p in old.placement if p["block"] not in after]:
        lines.append(f"{name}: block no longer exists")
    for name in [p["block"] for p in new.placement if p["block"] not in before]:
        lines.append(f"{name}: new block")
    for p in old.placement:
        q = after.get(p["block"])
        if q is None:
            continue
        changes = [f"{k} {p.get(k)} -> {q.get(k)}" for k in PLACEMENT_KEYS if p.get(k) != q.get(k)]
        changes += [f"exec.{ph} {p['exec'][ph]} -> {q['exec'][ph]}" for ph in p["exec"]
                    if p["exec"][ph] != q["exec"].get(ph)]
        if changes:
            lines.append(f"{p['block']}: " + ", ".join(changes))
    return lines


def reproducible(plan: Plan) -> bool:
    """A placement recompiles identically unless its solve was cut by wall-clock time: an
    incumbent at a time limit depends on the machine's speed (a node limit does not)."""
    return not plan.solver["status"].startswith("time_limit")


def _summary(plan: Plan) -> str:
    p = plan.predicted
    return (f"TTFT {format_seconds(p['ttft_s'])}, TPOT {format_seconds(p['tpot_s'])}, "
            f"{plan.solver['strategy']} {plan.solver['status']}")


def _recompile(old: Plan, req):
    """``old`` compiled again from its inputs: a serving plan with the serving options it
    records (``serving.max_batch``, ``max_context``, ``slo``), any other plan as compile did."""
    if old.serving is None:
        return compile_plan(req)
    from hetplan.serving import ServingRequest, compile_serving
    sv = old.serving
    return compile_serving(req, ServingRequest(max_batch=sv["max_batch"], max_context=sv["max_context"],
                                               slo_tpot_s=sv["slo"]["tpot_s"], slo_ttft_s=sv["slo"]["ttft_s"]))


def _replay_pipeline(plan: Plan) -> str | None:
    """A plan over several devices whose stages record their plans: what the independent replay of
    its pipeline finds wrong (``hetplan.plan.simulate_pipeline``), else None."""
    from hetplan.plan.simulate import PlanInvalid
    from hetplan.plan.simulate_pipeline import check_pipeline

    stages = (plan.pipeline or {}).get("stages") or []
    if not stages or any(s.get("plan") is None for s in stages):
        return None
    try:
        check_pipeline(plan)
    except PlanInvalid as e:
        return f"the pipeline does not replay as recorded: {e}"
    return None


def check_plan(path, tolerance: float = 0.01, allow_placement_change: bool = False,
               update: bool = False) -> CheckResult:
    """Recompile the plan at ``path`` and compare; with ``update``, rewrite it (atomically)
    with the recompiled plan instead of failing on a difference."""
    if tolerance < 0:
        raise HetplanError(f"--tolerance: must be >= 0, got {tolerance}")
    path = Path(path)
    if path.is_dir():
        raise HetplanError(f"{path}: no *.json plans in this directory")
    old = load_plan(path, verify=False)
    recorded = path.read_text()
    replayed = None if update else _replay_pipeline(old)
    if replayed is not None:
        return CheckResult(str(path), (replayed,), (), "")
    req = request_of(old, str(path))
    try:
        new, _ = _recompile(old, req)
    except HetplanError as e:  # memory over budget (InfeasibleError) or inputs that no longer load
        return CheckResult(str(path), (f"no longer compiles: {e}",), (), "")
    # the plan keeps its inputs as recorded (relative paths stay relative)
    recorded_args = old.inputs.get("cli_args", {})
    new = dataclasses.replace(new, inputs={
        **new.inputs, "model_source": old.inputs.get("model_source", req.model),
        "hw_source": old.inputs.get("hw_source", req.hw),
        "cli_args": {**new.inputs["cli_args"], "hw": recorded_args.get("hw"), "model": recorded_args.get("model")}})
    text = new.to_json()
    if update:
        changed = text != recorded
        if changed:
            write_atomic(path, text)
        return CheckResult(str(path), (), (), _summary(new), updated=changed)
    failures, notes = latency_diffs(old, new, tolerance)
    placement = placement_diffs(old, new)
    if placement:
        shown = placement[:MAX_DIFF_LINES]
        if len(placement) > MAX_DIFF_LINES:
            shown.append(f"... and {len(placement) - MAX_DIFF_LINES} more placement differences")
        shown[0] = "placement changed: " + shown[0]
        if not (reproducible(old) and reproducible(new)):
            shown[0] += " (not a failure: a solve stopped by its time limit has no unique placement)"
            notes.extend(shown)
        else:
            (notes if allow_placement_change else failures).extend(shown)
    summary = _summary(new) + ("" if text != recorded else ", identical")
    return CheckResult(str(path), tuple(failures), tuple(notes), summary)
