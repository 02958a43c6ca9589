"""One stage's own plan as plan.json records it (``pipeline.stages[i].plan``), and back.

A stage is planned as a single-GPU problem over its layer range (``stages.stage_problem``); what
that planner produced (its placement, staging, memory, predictions and schedule, layers numbered
from 0) is what a process needs to run the stage. The record leaves out what the whole plan
already holds: the model, the node and the workload. Reading it back derives them (the model's
layers ``[first, end)``, the stage's GPU alone, the same workload), so the stage's ``Plan`` is the
one the planner made. Knows nothing about executing a plan.
"""

from __future__ import annotations

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.plan.format import PhaseSchedule, Task
from hetplan.pipeline.stages import slice_model

STAGE_KEYS = ("solver", "placement", "staging", "memory", "predicted", "schedule")
"""The parts of a stage's single-GPU plan that the record keeps."""


def stage_record(plan: Plan) -> dict:
    """``plan`` (a stage's single-GPU plan) as ``pipeline.stages[i].plan`` records it."""
    d = plan.to_dict()
    out = {k: d[k] for k in STAGE_KEYS}
    if "cpu_attention_bytes_per_cache_byte" in d:
        out["cpu_attention_bytes_per_cache_byte"] = d["cpu_attention_bytes_per_cache_byte"]
    return out


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
    hw = plan.hardware
    gpu = st["gpu"]
    if st.get("node", 0) == 0:
        if gpu >= len(hw.gpus):
            raise HetplanError(f"plan pipeline.stages[{i}]: gpu {gpu}, but the plan's node "
                               f"{hw.name!r} has {len(hw.gpus)} GPUs; recompile the plan")
        hw = hw.single_gpu(gpu)
    sched = {ph: PhaseSchedule(tuple(Task(**t) for t in s["tasks"]), tuple(tuple(e) for e in s["edges"]))
             for ph, s in rec["schedule"].items()}
    return Plan(model=slice_model(plan.model, first, end), hardware=hw, workload=plan.workload,
                solver=rec["solver"], placement=tuple(rec["placement"]), staging=rec["staging"],
                memory=rec["memory"], predicted=rec["predicted"], schedule=sched,
                cpu_attention_bytes_per_cache_byte=rec.get("cpu_attention_bytes_per_cache_byte", 1.0))
