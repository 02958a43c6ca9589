"""The plan: what hetplan decided, and the vocabulary every other module speaks.

Vocabulary (written once, here):

- *block*: the unit of placement (``embed``, ``attn_l``, ``mlp_l``/``moe_l``, ``head``); it owns weights.
- *stage*: one compute task of a forward pass (an attention block has ``attn_in``,
  ``attn_core``, ``attn_out``); stages form a chain.
- *tier*: where bytes live: ``gpu`` (HBM) or ``cpu`` (DRAM).
- *device*: where compute runs: ``gpu`` or ``cpu``.
- *resource*: a serial queue of the timeline: ``gpu`` and ``cpu`` (compute), ``h2d`` (weight
  loads) and ``d2h`` (prompt KV leaving the GPU) on the copy engines, and ``h2d_act``/``d2h_act``
  (activation copies between stages, on their own high-priority streams).
- *phase*: ``prefill`` (the prompt, gives TTFT) or ``decode`` (one token per sequence, gives TPOT).
- a block's *weights* are ``gpu`` (resident in HBM), ``cpu`` (in DRAM, computed on the CPU) or
  ``stream`` (in pinned DRAM, copied into a GPU staging slot before use in at least one phase);
  its *exec* per phase is ``gpu``, ``cpu`` or ``stream``; an attention block's *kv* is ``gpu``
  or ``cpu`` (decode attention then runs on the CPU).
- an MoE block's *hot* experts are the routed experts resident in HBM beside its router and
  shared experts (the most frequently chosen first); its *cold* experts stay in DRAM and run on
  the CPU while the GPU runs the hot ones (stages ``moe_route``, ``moe_experts``, ``moe_cold``,
  ``moe_merge``: see ``hetplan.experts``); in a phase whose exec is ``stream`` its cold experts
  are loaded into a staging slot and run on the GPU instead. A block streamed whole or on the
  CPU has none hot.

A plan is data: frozen dataclasses with ``to_json``/``from_json`` and a schema version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from hetplan.canonical import rounded
from hetplan.errors import HetplanError
from hetplan.files import write_atomic  # noqa: F401  (re-exported: the one writer)
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.workload import Workload

SCHEMA_VERSION = 1
RESOURCES = ("gpu", "cpu", "h2d", "d2h", "h2d_act", "d2h_act")
TIERS = ("gpu", "cpu")
WEIGHTS = ("gpu", "cpu", "stream")


@dataclass(frozen=True)
class Decision:
    """What a solver decides; everything else in a plan is derived from it."""
    weights: dict
    """block -> ``gpu`` | ``cpu`` | ``stream``."""
    exec: dict
    """phase -> block -> ``gpu`` | ``cpu`` | ``stream``."""
    kv: dict
    """attention block -> ``gpu`` | ``cpu``."""
    depth: int = 2
    """Staging-buffer slots for streamed weights: a block's weights may be copied at most
    ``depth`` blocks ahead of use (1 = synchronous, as Accelerate's hooks do)."""
    experts: dict = field(default_factory=dict)
    """MoE block with weights ``gpu`` -> how many of its routed experts (the hottest) are
    resident in HBM; the others run on the CPU. Absent: all of them."""
    cpu_attention_bytes_per_cache_byte: float = 1.0
    """Bytes a decode ``attn_core`` task on the CPU moves over DRAM per byte of KV cache it
    reads. 1 = the cache is read in place, as hetplan's runtime runs it and the MILP prices it; a
    baseline that follows a tool whose CPU attention copies the cache first sets it (FlexGen:
    ``solvers.baselines.flexgen``)."""

    def device(self, phase: str, block: str) -> str:
        return "cpu" if self.exec[phase][block] == "cpu" else "gpu"

    def hot_experts(self, block: str, n_experts: int) -> int:
        """GPU-resident routed experts of MoE block ``block`` (0 unless its weights are ``gpu``)."""
        if self.weights[block] != "gpu":
            return 0
        return self.experts.get(block, n_experts)


@dataclass(frozen=True)
class Task:
    id: str
    resource: str
    block: str
    kind: str
    """A stage kind (``embed``, ``attn_in``, ``attn_core``, ``attn_out``, ``mlp``, ``moe``,
    ``moe_route``, ``moe_experts``, ``moe_cold``, ``moe_merge``, ``head``) or a transfer: ``load`` (weights h2d), ``act_up``, ``act_down``, ``kv_down``."""
    duration_s: float
    start_s: float = 0.0
    end_s: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    slot: int | None = None
    """Staging slot of a ``load`` and of the compute tasks that read it."""
    cost_source: str = "analytic"
    """Where ``duration_s`` came from: ``analytic`` (the roofline formulas and the node's
    bandwidths) or ``profile`` (a measured per-op table)."""


@dataclass(frozen=True)
class PhaseSchedule:
    tasks: tuple
    """Tasks in queue order: each resource runs its tasks in the order they appear here."""
    edges: tuple
    """(src id, dst id) dependencies: data, weight arrival and staging-slot reuse."""

    @property
    def makespan_s(self) -> float:
        return max((t.end_s for t in self.tasks), default=0.0)


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    solver: dict
    """strategy, status, mip_gap, objective_s, options."""
    placement: tuple
    """One dict per block: block, kind, layer, weights, exec {prefill, decode}, kv,
    experts_on_gpu, weight_bytes, kv_bytes."""
    staging: dict
    """depth, slot_bytes."""
    memory: dict
    predicted: dict
    schedule: dict
    """phase -> PhaseSchedule."""
    inputs: dict = field(default_factory=dict)
    cpu_attention_bytes_per_cache_byte: float = 1.0
    """``Decision.cpu_attention_bytes_per_cache_byte``; in plan.json only when it is not 1."""
    pipeline: dict | None = None
    """On a node with several GPUs: the stages over them (``hetplan.pipeline.PipelinePlan.to_dict``),
    beside the single-GPU plan the rest of the file describes; in plan.json only when set."""
    serving: dict | None = None
    """``compile --serve``: the engine's sizes and the curve against load (``hetplan.serving``);
    in plan.json only when set."""

    def decision(self) -> Decision:
        return Decision(weights={p["block"]: p["weights"] for p in self.placement},
                        exec={ph: {p["block"]: p["exec"][ph] for p in self.placement}
                              for ph in ("prefill", "decode")},
                        kv={p["block"]: p["kv"] for p in self.placement if p["kv"] is not None},
                        depth=self.staging["depth"],
                        experts={p["block"]: p["experts_on_gpu"] for p in self.placement
                                 if p.get("experts_on_gpu") is not None and p["weights"] == "gpu"},
                        cpu_attention_bytes_per_cache_byte=self.cpu_attention_bytes_per_cache_byte)

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "schema_version": SCHEMA_VERSION,
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "workload": self.workload.to_dict(),
            "solver": self.solver,
            "placement": list(self.placement),
            "staging": self.staging,
            "memory": self.memory,
            "predicted": self.predicted,
            "schedule": {ph: {"tasks": [t.__dict__ for t in s.tasks], "edges": [list(e) for e in s.edges]}
                         for ph, s in self.schedule.items()},
            "inputs": self.inputs,
        }
        if self.cpu_attention_bytes_per_cache_byte != 1.0:
            d["cpu_attention_bytes_per_cache_byte"] = self.cpu_attention_bytes_per_cache_byte
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline
        if self.serving is not None:
            d["serving"] = self.serving
        return d

    def to_json(self) -> str:
        d = rounded(self.to_dict())
        d["digest"] = content_digest(d)
        return json.dumps(d, sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan.json", verify: bool = True, text: str | None = None) -> "Plan":
        """Parse a plan, validated against ``hetplan.schema.plan`` (``text``, the file's JSON, gives
        errors their line). ``verify`` refuses a plan whose content no longer matches the digest
        it was written with (edited by hand); ``hetplan check`` reads goldens without it."""
        if not isinstance(d, dict) or "schema_version" not in d:
            raise HetplanError(f"{source}: not a hetplan plan (no schema_version)")
        v = d["schema_version"]
        if not isinstance(v, int) or v > SCHEMA_VERSION:
            raise HetplanError(f"{source}: schema_version {v!r} is newer than this hetplan understands "
                               f"({SCHEMA_VERSION}); upgrade hetplan or recompile the plan")
        if verify and "digest" in d and d["digest"] != content_digest(d):
            raise HetplanError(f"{source}: the plan was edited after it was compiled (content fingerprint "
                               f"mismatch); recompile it with `hetplan compile` (or `hetplan check --update`)")
        _validate(d, source, text)
        try:
            sched = {ph: PhaseSchedule(tuple(Task(**t) for t in s["tasks"]),
                                       tuple(tuple(e) for e in s["edges"]))
                     for ph, s in d["schedule"].items()}
            return cls(model=ModelSpec.from_dict(d["model"]), hardware=HardwareSpec.from_dict(d["hardware"]),
                       workload=Workload(**d["workload"]), solver=d["solver"],
                       placement=tuple(d["placement"]), staging=d["staging"], memory=d["memory"],
                       predicted=d["predicted"], schedule=sched, inputs=d.get("inputs", {}),
                       cpu_attention_bytes_per_cache_byte=d.get("cpu_attention_bytes_per_cache_byte", 1.0),
                       pipeline=d.get("pipeline"), serving=d.get("serving"))
        except HetplanError as e:
            raise HetplanError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise HetplanError(f"{source}: malformed plan ({type(e).__name__}: {e}); "
                               f"recompile it with `hetplan compile`") from None

    @classmethod
    def from_json(cls, text: str, source: str = "plan.json", verify: bool = True) -> "Plan":
        from hetplan.files import parse_json

        d = parse_json(text, source, "; the plan may be truncated: recompile it")
        return cls.from_dict(d, source, verify, text=text)


def _validate(d: dict, source: str, text: str | None) -> None:
    """Refuse a plan that breaks the schema, in one line naming the file, line and key."""
    from hetplan.schema.errors import validate_json
    from hetplan.schema.plan import PlanFile

    validate_json(PlanFile, d, source, text, "a plan", "; recompile it with `hetplan compile`")


def content_digest(d: dict) -> str:
    """sha256 (16 hex digits) of a plan's canonical JSON without its ``digest`` key."""
    body = {k: v for k, v in d.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def load_plan(path: str | Path, verify: bool = True) -> Plan:
    from hetplan.files import read_text

    p = Path(path)
    text = read_text(p, "plan file", "a plan.json written by `hetplan compile`")
    return Plan.from_json(text, source=str(p), verify=verify)
