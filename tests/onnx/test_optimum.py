"""ONNX files made by optimum's own exporter (``optimum-cli export onnx``, kept in
``tests/onnx/optimum/``; ``make.py`` there regenerates them) plan and run, their logits matching
onnxruntime's on the same file under CPU, GPU and mixed plans, with and without past KV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from tests.onnx.test_exec import GEN, PLANS, PROMPT, TOL, _mixed_plan, _reference_logits  # noqa: E402

from hetplan.runtime.session import RunOptions, run_plan  # noqa: E402

FILES = Path(__file__).resolve().parent / "optimum"
CASES = [(family, past) for family in ("llama", "gpt2") for past in (False, True)]


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("family,with_past", CASES)
def test_optimum_export_matches_onnxruntime(family, with_past, plan_kind):
    path = FILES / f"{family}{'-past' if with_past else ''}.onnx"
    plan = _mixed_plan(path, kind=plan_kind)
    res = run_plan(plan, RunOptions(prompt_ids=PROMPT, emulate=True, all_logits=True, keep_logits=True))
    ref = _reference_logits(path, with_past, res.tokens, plan.model)
    assert len(res.logits) == len(ref) == GEN
    for got, want in zip(res.logits, ref):
        np.testing.assert_allclose(got.numpy(), want, atol=TOL, rtol=0)
    want_tokens = [r.reshape(2, -1, r.shape[-1])[:, -1].argmax(-1) for r in ref]
    assert res.tokens == np.stack(want_tokens, axis=1).tolist()
