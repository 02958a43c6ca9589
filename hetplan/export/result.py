"""What an export produces, and what it costs: the engine's configuration, the ``--strategy``
that re-reads it, what the engine could not express, and the exported configuration priced as
that engine's faithful baseline on the plan's own model, machine and workload.

Pricing re-reads the exported text with the engine's reader (``hetplan.solvers.imported``), so
what is priced is what the engine would be told, not what the exporter meant. Knows nothing
about any engine's syntax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision, Plan
from hetplan.export.regex import runs

ENGINES = ("llama.cpp", "accelerate", "vllm", "ktransformers")


class CannotExpress(HetplanError):
    """The engine can express no part of the plan (nothing is written)."""


@dataclass(frozen=True)
class Export:
    engine: str
    text: str
    """The configuration, as the engine's users write it (the file ``-o`` writes)."""
    strategy: str
    """``--strategy`` that re-reads ``text`` (``from-llama.cpp:ARGS``...)."""
    notes: tuple = field(default_factory=tuple)
    """What the engine cannot express of this plan, and how the export approximates it."""
    usage: str = ""
    """How to use the file (e.g. the Python snippet that loads with an Accelerate device map)."""


@dataclass(frozen=True)
class Price:
    plan: Plan
    """The exported configuration compiled as the engine's baseline."""
    missing_bytes: dict
    """tier -> bytes over budget (empty when it fits)."""
    differences: tuple
    """Where the exported placement differs from the plan's, one line per group of blocks."""


def price(plan: Plan, exported: Export) -> Price:
    """Compile ``exported.strategy`` on the problem ``plan`` was solved on."""
    from hetplan.compiler import CompileRequest, decide
    from hetplan.evaluate import make_plan
    from hetplan.plan.compare import missing_bytes
    from hetplan.problem import build_problem
    from hetplan.routing import routing_of_plan

    problem = build_problem(plan.model, plan.hardware, plan.workload, routing=routing_of_plan(plan))
    name, _, arg = exported.strategy.partition(":")
    req = CompileRequest(model=plan.inputs.get("model_source") or plan.model.name, hw=plan.hardware.name)
    dec, info, _ = decide(problem, name, arg, req)
    priced = make_plan(problem, dec, info)
    return Price(priced, missing_bytes(priced), tuple(differences(plan, dec)))


def differences(plan: Plan, exported: Decision) -> list:
    """Lines naming where ``exported`` places or executes blocks otherwise than ``plan``:
    grouped by (what, block kind, plan's value, engine's value), with the layers."""
    ours = plan.decision()
    n_experts = plan.model.n_experts
    groups: dict = {}
    for p in plan.placement:
        b = p["block"]
        items = [("weights", ours.weights[b], exported.weights[b])]
        items += [(f"{ph} exec", ours.exec[ph][b], exported.exec[ph][b]) for ph in PHASES]
        if p["kv"] is not None:
            items.append(("KV cache", ours.kv[b], exported.kv.get(b)))
        if p["kind"] == "moe":
            items.append(("experts on GPU", ours.hot_experts(b, n_experts), exported.hot_experts(b, n_experts)))
        for what, a, e in items:
            if a != e:
                groups.setdefault((what, p["kind"], a, e), []).append(p["layer"])
    if ours.depth != exported.depth and any(w == "stream" for w in exported.weights.values()):
        groups[("staging depth", "", ours.depth, exported.depth)] = []
    return [f"{what}{' of ' + kind if kind else ''}{_layers(layers)}: plan {a}, exported {e}"
            for (what, kind, a, e), layers in groups.items()]


def _layers(layers: list) -> str:
    ls = [l for l in layers if l is not None]
    if not ls:
        return ""
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs(ls)]
    return f" (layer{'s' if len(ls) > 1 else ''} {', '.join(parts)})"


def export(plan: Plan, engine: str) -> Export:
    """The closest configuration of ``engine`` to ``plan``; raises CannotExpress when it has none."""
    from hetplan.export import accelerate, ktransformers, llama_cpp, vllm

    emit = {"llama.cpp": llama_cpp.emit, "accelerate": accelerate.emit, "vllm": vllm.emit,
            "ktransformers": ktransformers.emit}
    if engine not in emit:
        raise HetplanError(f"--to {engine}: unknown engine; choose one of {', '.join(ENGINES)}")
    return emit[engine](plan)
