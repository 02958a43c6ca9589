"""What plan.json records for each stage (``pipeline.stages[].plan``) and the part of it a stage
process runs: the stage's own plan read back as the planner made it, a strict schema, and the
embedding and head cut out of the stages that do not hold them without losing any order."""

from __future__ import annotations

import json

import pytest

from hetplan.canonical import rounded
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.pipeline.cluster import load_hardware
from hetplan.pipeline.record import STAGE_KEYS, stage_plan, whole_model
from hetplan.plan import Plan
from hetplan.plan.format import PhaseSchedule, Task
from hetplan.runtime.distributed.part import stage_part, without_blocks
from hetplan.runtime.distributed.worker import PipelineResult


@pytest.fixture(scope="module")
def compiled(llama_files):
    """A plan compiled by ``hetplan compile`` over the tiny node with GPUs of 1 MiB: the weights
    (544 KiB) and the KV cache of 600 tokens (600 KiB) fit in no one GPU."""
    model_dir, node, _ = llama_files
    small = node.read_text().replace("64MiB", "1MiB")
    path = node.parent / "small.yaml"
    path.write_text(small)
    plan, _ = compile_plan(CompileRequest(model=str(model_dir), hw=str(path), prompt_len=300, gen_len=300,
                                          weight_dtype="fp32"))
    return plan


def test_each_stage_records_the_plan_its_planner_made(compiled):
    from hetplan.pipeline import plan_pipeline
    from hetplan.compiler import stage_solver
    loaded = Plan.from_json(compiled.to_json())
    assert len(loaded.pipeline["stages"]) >= 2
    whole, node = whole_model(loaded), load_hardware(compiled.inputs["hw_source"])
    pp = plan_pipeline(whole, node, compiled.workload,
                       stage_solver(CompileRequest(model="x", hw="x"), moe_stages=True), "sum")
    for i, st in enumerate(pp.stages):
        got = stage_plan(loaded, i)
        assert got.model.n_layers == st.end_layer - st.first_layer
        assert got.hardware.gpus == (node.gpus[st.gpu],)
        want = rounded(st.plan.to_dict())
        assert {k: rounded(got.to_dict())[k] for k in STAGE_KEYS} == {k: want[k] for k in STAGE_KEYS}


def test_a_stage_plan_with_an_unknown_key_is_refused_in_one_line(compiled):
    d = json.loads(compiled.to_json())
    d.pop("digest")
    d["pipeline"]["stages"][0]["plan"]["placement"][1]["weigths"] = "gpu"
    with pytest.raises(HetplanError, match=r"weigths.*pipeline\.stages\[0\]\.plan\.placement\[1\]"):
        Plan.from_dict(d)


def test_a_stage_plan_task_of_a_block_it_does_not_place_is_refused(compiled):
    d = json.loads(compiled.to_json())
    d.pop("digest")
    d["pipeline"]["stages"][1]["plan"]["schedule"]["decode"]["tasks"][0]["block"] = "attn_99"
    with pytest.raises(HetplanError, match="attn_99"):
        Plan.from_dict(d)


def test_a_pipeline_written_without_stage_plans_is_refused_by_exec(compiled):
    d = json.loads(compiled.to_json())
    d.pop("digest")
    for st in d["pipeline"]["stages"]:
        st.pop("plan")
    with pytest.raises(HetplanError, match=r"stages\[0\]: records no plan of its own.*recompile"):
        stage_plan(Plan.from_dict(d), 0)


def test_middle_stages_run_without_embedding_or_head_and_with_their_layers_in_the_model(compiled):
    stages = compiled.pipeline["stages"]
    L = whole_model(compiled).n_layers
    for i, st in enumerate(stages):
        a, b = st["layers"]
        part = stage_part(stage_plan(compiled, i), whole_model(compiled), a, b)
        blocks = {p["block"] for p in part.placement}
        assert ("embed" in blocks) == (a == 0) and ("head" in blocks) == (b == L)
        assert sorted(p["layer"] for p in part.placement if p["layer"] is not None) == \
            sorted([l for l in range(a, b)] * 2)
        assert blocks - {"embed", "head"} == {f"{k}_{l}" for k in ("attn", "mlp") for l in range(a, b)}
        for sched in part.schedule.values():
            assert all(t.block in blocks and t.id.endswith("/" + t.block) for t in sched.tasks)
            ids = {t.id for t in sched.tasks}
            assert all(src in ids and dst in ids for src, dst in sched.edges)


def task(id_, resource, block, kind="mlp"):
    return Task(id=id_, resource=resource, block=block, kind=kind, duration_s=1.0)


def test_dropping_a_task_keeps_every_order_that_went_through_it():
    """a (gpu) -> x (cpu, dropped) -> c (gpu) by edges, and y (cpu) after x in its queue: a must
    still precede c and y; b, before x in x's queue, must precede x's successor c."""
    tasks = (task("a", "gpu", "A"), task("b", "cpu", "B"), task("x", "cpu", "X"), task("y", "cpu", "Y"),
             task("c", "gpu", "C"))
    out = without_blocks(PhaseSchedule(tasks, (("a", "x"), ("x", "c"))), {"X"})
    assert [t.id for t in out.tasks] == ["a", "b", "y", "c"]
    assert set(out.edges) == {("a", "c"), ("a", "y"), ("b", "c"), ("b", "y")}


def test_a_pipeline_result_is_comparable_only_without_emulated_stages():
    base = dict(tokens=[[1]], text=None, measured={}, predicted={}, stages=[])
    assert PipelineResult(modes=["cuda", "cpu"], **base).comparable
    assert not PipelineResult(modes=["cuda", "emulated"], **base).comparable


def test_a_compiled_pipeline_runs_as_its_stage_processes_and_matches_transformers(compiled, llama_files):
    """What ``hetplan compile`` wrote (the main part the first stage's layers, the whole model in
    ``pipeline.model``) runs as one process per stage and decodes transformers' greedy tokens."""
    import torch
    from hetplan.runtime.distributed.launch import run_pipeline
    from hetplan.runtime.session import RunOptions

    model_dir, _, model = llama_files
    assert compiled.model.n_layers < whole_model(compiled).n_layers
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    opts = RunOptions(weights=str(model_dir), prompt_ids=tuple(ids.tolist()), gen_len=6, emulate=True)
    result = run_pipeline(compiled, opts, timeout_s=60)
    assert result.tokens == want[:, 16:].tolist()
    assert [s["layers"] for s in result.stages] == [st["layers"] for st in compiled.pipeline["stages"]]
