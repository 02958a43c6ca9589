"""ONNX files made by optimum's own exporter (``optimum-cli export onnx``, kept in
``tests/onnx/optimum/``; ``make.py`` there regenerates them) plan and run, their logits matching
onnxruntime's on the same file under CPU, GPU and mixed plans, with and without past KV."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from tests.onnx.test_exec import PLANS, PROMPT, _mixed_plan, check_against_onnxruntime  # noqa: E402

from hetplan.runtime.session import RunOptions, run_plan  # noqa: E402

FILES = Path(__file__).resolve().parent / "optimum"
CASES = [(family, past) for family in ("llama", "gpt2") for past in (False, True)]


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("family,with_past", CASES)
def test_optimum_export_matches_onnxruntime(family, with_past, plan_kind):
    path = FILES / f"{family}{'-past' if with_past else ''}.onnx"
    plan = _mixed_plan(path, kind=plan_kind)
    res = run_plan(plan, RunOptions(prompt_ids=PROMPT, emulate=True, all_logits=True, keep_logits=True))
    check_against_onnxruntime(res, path, with_past, plan)
