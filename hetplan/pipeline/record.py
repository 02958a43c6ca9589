"""One stage's own plan as plan.json records it (``pipeline.stages[i].plan``), and back.

A stage is planned as a single-device problem over its layer range (``stages.device_problem``
on ``Topology.device_hw``: one GPU of a node alone, or a node's CPU); what that planner produced
(its placement, staging, memory, predictions and schedule, layers numbered from 0) and the
single-device machine it was planned on are what a process needs to run the stage. The record
leaves out what the whole plan already holds: the model and the workload. Reading it back derives
them (the model's layers ``[first, end)``, the same workload), so the stage's ``Plan`` is the one
the planner made. Knows nothing about executing a plan.
"""

from __future__ import annotations

from hetplan.errors import HetplanError
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.plan.format import PhaseSchedule, Task
from hetplan.pipeline.stages import slice_model

STAGE_KEYS = ("hardware", "solver", "placement", "staging", "memory", "predicted", "schedule")
"""The parts of a stage's single-device plan that the record keeps."""


def replicas_of(plan: Plan) -> int:
    """Replicas the plan runs (``pipeline.replicas``; 1 without a pipeline or replicas)."""
    return (plan.pipeline or {}).get("replicas") or 1


def stage_record(plan: Plan) -> dict:
    """``plan`` (a stage's single-device plan) as ``pipeline.stages[i].plan`` records it."""
    d = plan.to_dict()
    out = {k: d[k] for k in STAGE_KEYS}
    if "cpu_attention_bytes_per_cache_byte" in d:
        out["cpu_attention_bytes_per_cache_byte"] = d["cpu_attention_bytes_per_cache_byte"]
    return out


def whole_model(plan: Plan) -> ModelSpec:
    """The model ``plan.pipeline``'s stages cut: ``pipeline.model``, or the plan's own where the
    pipeline does not record one (its main part then holds the whole model)."""
    rec = (plan.pipeline or {}).get("model")
    return ModelSpec.from_dict(rec) if rec is not None else plan.model


def stage_plan(plan: Plan, i: int) -> Plan:
    """Stage ``i`` of ``plan.pipeline`` as the Plan its planner made (layers numbered from 0,
    the embedding and the head present but free outside the first and the last stage)."""
    stages = (plan.pipeline or {}).get("stages", [])
    if not 0 <= i < len(stages):
        raise HetplanError(f"plan pipeline: no stage {i} (the plan has {len(stages)})")
    st = stages[i]
    rec = st.get("plan")
    if rec is None:
        raise HetplanError(f"plan pipeline.stages[{i}]: records no plan of its own (written by an older "
                           f"hetplan); recompile the plan with `hetplan compile` to run its pipeline")
    first, end = st["layers"]
    hw = HardwareSpec.from_dict(rec["hardware"])
    sched = {ph: PhaseSchedule(tuple(Task(**t) for t in s["tasks"]), tuple(tuple(e) for e in s["edges"]))
             for ph, s in rec["schedule"].items()}
    return Plan(model=slice_model(whole_model(plan), first, end), hardware=hw, workload=plan.workload,
                solver=rec["solver"], placement=tuple(rec["placement"]), staging=rec["staging"],
                memory=rec["memory"], predicted=rec["predicted"], schedule=sched,
                cpu_attention_bytes_per_cache_byte=rec.get("cpu_attention_bytes_per_cache_byte", 1.0))
