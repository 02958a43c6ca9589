"""Specification of ``hetplan check``: a checked-in plan is recompiled from its recorded inputs
and any regression (slower prediction, memory over budget, different placement) fails it."""

import json
from pathlib import Path

import pytest

from hetplan.plan.check import check_plan, plan_paths, request_of
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.evaluate import fits
from hetplan.plan import load_plan

PLANS_DIR = Path(__file__).resolve().parent.parent / "plans"


@pytest.fixture(scope="module")
def fresh_text():
    plan, _ = compile_plan(CompileRequest(model="llama-3.1-8b", hw="rtx4090-64g"))
    return plan.to_json()


@pytest.fixture
def golden(tmp_path, fresh_text):
    path = tmp_path / "golden.json"
    path.write_text(fresh_text)
    return path


def edit(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")


def test_an_unchanged_plan_passes_and_recompiles_identically(golden):
    res = check_plan(golden)
    assert res.ok and not res.notes and res.summary.endswith("identical")


def test_a_prediction_worse_than_the_tolerance_fails(golden):
    edit(golden, lambda d: d["predicted"].update(ttft_s=d["predicted"]["ttft_s"] / 1.05))
    res = check_plan(golden, tolerance=0.01)
    assert not res.ok
    assert len(res.failures) == 1 and res.failures[0].startswith("ttft_s:")
    assert "+5.00%" in res.failures[0] and "1% tolerance" in res.failures[0]


def test_a_prediction_worse_within_the_tolerance_passes(golden):
    edit(golden, lambda d: d["predicted"].update(latency_s=d["predicted"]["latency_s"] / 1.005))
    assert check_plan(golden, tolerance=0.01).ok
    assert not check_plan(golden, tolerance=0.001).ok


def test_an_improvement_is_noted_not_failed(golden):
    edit(golden, lambda d: d["predicted"].update(tpot_s=d["predicted"]["tpot_s"] * 2))
    res = check_plan(golden)
    assert res.ok and any(n.startswith("tpot_s:") and "improved" in n for n in res.notes)


def set_weights(block, tier):
    def change(doc):
        for p in doc["placement"]:
            if p["block"] == block:
                p["weights"] = tier
    return change


def test_a_placement_change_fails_and_names_the_block(golden):
    edit(golden, set_weights("mlp_7", "stream"))
    res = check_plan(golden)
    assert not res.ok
    assert res.failures == ("placement changed: mlp_7: weights stream -> gpu",)


def test_a_placement_change_can_be_allowed(golden):
    edit(golden, set_weights("mlp_7", "cpu"))
    res = check_plan(golden, allow_placement_change=True)
    assert res.ok and res.notes == ("placement changed: mlp_7: weights cpu -> gpu",)


def test_a_time_limited_solve_may_change_placement_without_failing(golden):
    def change(doc):
        set_weights("mlp_7", "cpu")(doc)
        doc["solver"]["status"] = "time_limit"
    edit(golden, change)
    res = check_plan(golden)
    assert res.ok and "time limit" in res.notes[0]


def test_update_rewrites_a_changed_plan_with_the_recompiled_one(golden, fresh_text):
    edit(golden, set_weights("mlp_7", "cpu"))
    res = check_plan(golden, update=True)
    assert res.ok and res.updated and golden.read_text() == fresh_text
    again = check_plan(golden, update=True)
    assert again.ok and not again.updated


def test_a_plan_that_no_longer_fits_fails_with_the_missing_memory(golden):
    # all-gpu needs the whole ~15 GiB model on a GPU now limited to 8 GiB
    edit(golden, lambda d: d["inputs"]["cli_args"].update(strategy="all-gpu", gpu_mem="8GiB"))
    res = check_plan(golden)
    assert not res.ok and res.failures[0].startswith("no longer compiles") and "GPU needs" in res.failures[0]


def test_a_plan_without_recorded_inputs_cannot_be_checked(golden):
    edit(golden, lambda d: d["inputs"].pop("cli_args"))
    with pytest.raises(HetplanError, match="inputs.cli_args"):
        check_plan(golden)


def test_unknown_recorded_input_keys_are_named(golden):
    edit(golden, lambda d: d["inputs"]["cli_args"].update(turbo=True))
    with pytest.raises(HetplanError, match="turbo"):
        check_plan(golden)


def test_directories_expand_to_their_sorted_json_files(tmp_path):
    for name in ("b.json", "a.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in plan_paths([tmp_path])] == ["a.json", "b.json"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(HetplanError, match="no \\*.json"):
        plan_paths([tmp_path / "empty"])


GOLDENS = sorted(PLANS_DIR.glob("*.json"))


def test_there_are_goldens_for_dense_and_moe_models_on_several_machines():
    plans = [load_plan(p) for p in GOLDENS]
    assert len(plans) >= 8
    assert {p.model.arch for p in plans if p.model.n_experts} and {p.model.arch for p in plans if not p.model.n_experts}
    assert len({p.hardware.name for p in plans}) >= 5


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_each_golden_fits_its_budget_and_records_how_to_recompile_it(path):
    plan = load_plan(path)
    req = request_of(plan, str(path))
    assert fits(plan)
    assert (req.batch >= plan.workload.batch, req.prompt_len, req.gen_len, req.objective) == \
        (True, plan.workload.prompt_len, plan.workload.gen_len, plan.workload.objective)
    assert path.read_text() == plan.to_json()  # stored exactly as the compiler writes it
