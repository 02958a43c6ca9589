"""The published-point files behind the calibrated defaults (bench/published/*.json): every
point parses, maps to a strategy that compiles, and a malformed point is refused by name."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PA = bench_module("published_accuracy")
POINTS, PROBLEMS = PA.load_points()


def test_every_file_parses_and_there_are_at_least_25_points():
    assert PROBLEMS == []
    assert len(POINTS) >= 25
    assert len({p["file"] for p in POINTS}) >= 5


@pytest.mark.parametrize("point", POINTS, ids=[p["id"] for p in POINTS])
def test_every_point_compiles_with_the_strategy_that_reproduces_the_tool(point, tmp_path):
    runner = PA.Runner(None, keep=tmp_path)
    pred, why = runner.predict(point, {})
    assert pred is not None and pred > 0, why
    plan = json.loads((tmp_path / point["id"] / "plan.json").read_text())
    assert plan["solver"]["strategy"] == point["strategy"]


def one_file(tmp_path: Path, edit) -> list[str]:
    src = json.loads((ROOT / "bench" / "published" / "llamacpp-pr4812-3090ti.json").read_text())
    doc = copy.deepcopy(src)
    edit(doc)
    (tmp_path / "f.json").write_text(json.dumps(doc))
    return PA.load_points(tmp_path)[1]


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["points"][0]["source"].pop("quote"), "source.quote"),
    (lambda d: [d["source"].pop(k) for k in ("url", "repo", "ref")], "'source' needs 'url'"),
    (lambda d: d["points"][0].update(unit="tok/s"), "'unit'"),
    (lambda d: d["hardware"]["rtx3090ti-unpublished-host"]["gpu"].update(memory="24"), "explicit unit"),
    (lambda d: d["points"][0].update(hardware="nowhere"), "hardware 'nowhere'"),
    (lambda d: d["hardware"]["rtx3090ti-unpublished-host"].pop("gpu") and None, "unpublished"),
    (lambda d: d["points"][0].update(strategy="ngl-fast"), "unknown strategy"),
])
def test_a_malformed_point_is_refused_naming_the_file_and_the_point(tmp_path, edit, needle):
    problems = one_file(tmp_path, edit)
    assert problems, "the malformed file was accepted"
    assert any("f.json" in line and "point " in line and needle in line for line in problems), problems


def test_the_bench_exits_2_on_a_malformed_file(tmp_path):
    one_file(tmp_path, lambda d: d["points"][0]["source"].pop("quote"))
    assert PA.main(["--data", str(tmp_path), "--check"]) == 2


def test_flexgen_policies_map_to_flexgen_with_the_policys_gpu_weight_percent(tmp_path):
    # FlexGen's own runs that split weights between GPU and DRAM are compiled with flexgen:W, W the
    # policy's "weights % GPU"; the policy (20x4, 4, 96, 0, 100, 0, 100) keeps no OPT matrix in HBM
    # (mid-points 12.5..87.5 % < 96 %) and its KV cache in DRAM
    import re
    split = [p for p in POINTS if p["tool"]["name"] == "FlexGen"
             and re.search(r"policy \(\d+×\d+, (\d+), (\d+),", p["setting"])
             and 0 < int(re.search(r"policy \(\d+×\d+, (\d+),", p["setting"]).group(1)) < 100]
    assert split, "no FlexGen point with a partial weight split"
    for p in split:
        w = int(re.search(r"policy \(\d+×\d+, (\d+),", p["setting"]).group(1))
        assert p["strategy"] == f"flexgen:{w}", p["id"]
    p = next(p for p in split if p["id"] == "flexgen-paper-opt-30b-t4-flexgen-b80")
    PA.Runner(None, keep=tmp_path).predict(p, {})
    plan = json.loads((tmp_path / p["id"] / "plan.json").read_text())
    assert {b["weights"] for b in plan["placement"] if b["kind"] != "embed"} == {"stream"}
    assert {b["kv"] for b in plan["placement"] if b["kind"] == "attn"} == {"cpu"}
