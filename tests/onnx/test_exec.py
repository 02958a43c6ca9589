"""Executing ONNX plans: logits match onnxruntime on the same inputs, whatever the placement."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("transformers")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from tests.onnx.exports import EXPORTERS, export  # noqa: E402

from hetplan.cli import main  # noqa: E402
from hetplan.evaluate import make_plan  # noqa: E402
from hetplan.hardware import load_node  # noqa: E402
from hetplan.frontends.resolve import load_model  # noqa: E402
from hetplan.frontends.onnx.ir import from_proto  # noqa: E402
from hetplan.frontends.onnx.opset import SUPPORTED_OPS  # noqa: E402
from hetplan.frontends.onnx.shapes import RULES, infer  # noqa: E402
from hetplan.plan import Decision, write_atomic  # noqa: E402
from hetplan.problem import build_problem  # noqa: E402
from hetplan.runtime.onnx.ops import OPS  # noqa: E402
from hetplan.runtime.onnx.run import run_nodes  # noqa: E402
from hetplan.runtime.session import RunOptions, run_plan  # noqa: E402
from hetplan.workload import Workload  # noqa: E402

PROMPT = ((3, 17, 42, 9, 100), (5, 6, 7, 8, 9))
GEN = 4
TOL = 1e-4


PLANS = ("mixed", "cpu", "gpu")
CASES = [(family, with_past, exporter) for exporter in EXPORTERS for family in ("llama", "gpt2")
         for with_past in (False, True)]


def _mixed_plan(path, depth=2, kind="mixed"):
    """``mixed``: blocks cycling through CPU, GPU-resident and streamed placement (embedding on
    the CPU); streamed MLP and head blocks compute on the CPU in decode (attention stays beside
    its cache, on the CPU for CPU blocks). ``cpu`` / ``gpu``: every block and cache there."""
    spec = load_model(str(path))
    problem = build_problem(spec, load_node("rtx4090-64g"), Workload(batch=2, prompt_len=5, gen_len=GEN))
    cycle = ("gpu", "stream", "cpu")  # attn_0 streamed, mlp_0 cpu, attn_1 gpu, mlp_1 streamed, head cpu
    if kind == "mixed":
        weights = {b.name: "cpu" if b.kind == "embed" else cycle[i % 3] for i, b in enumerate(problem.blocks)}
    else:
        weights = {b.name: kind for b in problem.blocks}
    kv = {b.name: "cpu" if weights[b.name] == "cpu" else "gpu" for b in problem.blocks if b.kind == "attn"}
    decode = {b.name: "cpu" if weights[b.name] == "stream" and b.kind != "attn" else weights[b.name]
              for b in problem.blocks}
    dec = Decision(weights, {"prefill": dict(weights), "decode": decode}, kv, depth=depth)
    return make_plan(problem, dec, {"strategy": "manual", "status": "heuristic", "mip_gap": None, "options": {}})


def _feeds(names, ids, past_len, past):
    """onnxruntime inputs: the token ids, an all-ones mask, positions after ``past_len`` cached
    tokens (optimum's signature) and the past key/values."""
    batch, seq = ids.shape
    feeds = {"input_ids": ids}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((batch, past_len + seq), np.int64)
    if "position_ids" in names:
        feeds["position_ids"] = np.broadcast_to(np.arange(past_len, past_len + seq), (batch, seq)).copy()
    feeds.update(zip([n for n in names if "past" in n], past))
    return feeds


def _reference_logits(path, with_past, generated, spec) -> list:
    """onnxruntime's logits for the prompt (every position), then for each generated token fed back."""
    sess = ort.InferenceSession(str(path))
    names = [i.name for i in sess.get_inputs()]
    ids = np.array(PROMPT, dtype=np.int64)
    gen = np.array(generated, dtype=np.int64)
    out = []
    if with_past:
        n_past = sum("past" in n for n in names)
        res = sess.run(None, _feeds(names, ids, 0, [np.zeros((2, spec.n_kv_heads, 0, spec.head_dim), np.float32)]
                                    * n_past))
        out.append(res[0])
        for i in range(GEN - 1):
            res = sess.run(None, _feeds(names, gen[:, i:i + 1], ids.shape[1] + i, res[1:]))
            out.append(res[0][:, -1])
    else:
        seq = ids
        out.append(sess.run(None, _feeds(names, seq, 0, []))[0])
        for i in range(GEN - 1):
            seq = np.concatenate([seq, gen[:, i:i + 1]], axis=1)
            out.append(sess.run(None, _feeds(names, seq, 0, []))[0][:, -1])
    return out


@pytest.mark.parametrize("plan_kind", PLANS)
@pytest.mark.parametrize("family,with_past,exporter", CASES)
def test_exec_matches_onnxruntime_under_each_placement(family, with_past, exporter, plan_kind):
    path, _, _ = export(family, with_past, exporter)
    plan = _mixed_plan(path, kind=plan_kind)
    want_tiers = {"mixed": {"cpu", "gpu", "stream"}, "cpu": {"cpu"}, "gpu": {"gpu"}}[plan_kind]
    assert {p["weights"] for p in plan.placement} == want_tiers
    res = run_plan(plan, RunOptions(prompt_ids=PROMPT, emulate=True, all_logits=True, keep_logits=True))
    assert res.mode == ("cpu" if plan_kind == "cpu" else "emulated")
    check_against_onnxruntime(res, path, with_past, plan)


def check_against_onnxruntime(res, path, with_past, plan) -> None:
    """Every logit within TOL of onnxruntime's on the same inputs, and greedy decoding: each
    generated token is the argmax of onnxruntime's logits before it."""
    ref = _reference_logits(path, with_past, res.tokens, plan.model)
    assert len(res.logits) == len(ref) == GEN
    for got, want in zip(res.logits, ref):
        np.testing.assert_allclose(got.numpy(), want, atol=TOL, rtol=0)
    want_tokens = [r.reshape(2, -1, r.shape[-1])[:, -1].argmax(-1) for r in ref]
    assert res.tokens == np.stack(want_tokens, axis=1).tolist()


def test_dynamo_export_builds_its_mask_with_gather_nd():
    """The operator that used to refuse these exports is in the graph this suite runs."""
    ops = {n.op_type for n in onnx.load(str(export("llama", True, "dynamo")[0])).graph.node}
    assert "GatherND" in ops


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_with_and_without_past_generate_the_same_tokens(exporter):
    a = run_plan(_mixed_plan(export("llama", True, exporter)[0]), RunOptions(prompt_ids=PROMPT, emulate=True))
    b = run_plan(_mixed_plan(export("llama", False, exporter)[0], depth=1), RunOptions(prompt_ids=PROMPT, emulate=True))
    assert a.tokens == b.tokens


def test_exec_cli_runs_an_onnx_plan_with_external_data(tmp_path, capsys):
    src, _, _ = export("gpt2", True)
    path = tmp_path / "ext.onnx"
    onnx.save_model(onnx.load(str(src)), str(path), save_as_external_data=True, location="ext.weights",
                    size_threshold=256)
    plan = _mixed_plan(path)
    write_atomic(tmp_path / "plan.json", plan.to_json())
    prompt = ";".join(",".join(map(str, seq)) for seq in PROMPT)
    rc = main(["exec", str(tmp_path / "plan.json"), "--model", str(path), "--prompt-ids", prompt,
               "--emulate", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    tokens = json.loads(out)["tokens"]
    ref = _reference_logits(src, True, tokens, plan.model)
    want = [r.reshape(2, -1, r.shape[-1])[:, -1].argmax(-1) for r in ref]
    assert tokens == np.stack(want, axis=1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_exec_on_cuda_matches_onnxruntime(exporter):
    path, _, _ = export("llama", True, exporter)
    plan = _mixed_plan(path)
    res = run_plan(plan, RunOptions(prompt_ids=PROMPT, emulate=False, all_logits=True, keep_logits=True))
    assert res.mode == "cuda"
    for got, want in zip(res.logits, _reference_logits(path, True, res.tokens, plan.model)):
        np.testing.assert_allclose(got.numpy(), want, atol=TOL, rtol=0)


# -- single operators against onnxruntime ----------------------------------------------------------

def test_every_supported_operator_has_a_shape_rule_and_a_torch_kernel():
    assert set(OPS) == SUPPORTED_OPS
    assert SUPPORTED_OPS <= set(RULES)


def _f(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _i(values):
    return np.array(values, dtype=np.int64)


OP_CASES = {
    "Trilu": (helper.make_node("Trilu", ["x", "k"], ["y"], upper=0), {"x": _f(3, 4, 4)}, {"k": _i(1)}),
    "CumSum": (helper.make_node("CumSum", ["x", "a"], ["y"], exclusive=1, reverse=1), {"x": _f(3, 4)},
               {"a": _i(1)}),
    "Gelu": (helper.make_node("Gelu", ["x"], ["y"], approximate="tanh"), {"x": _f(2, 5)}, {}),
    "Erf": (helper.make_node("Erf", ["x"], ["y"]), {"x": _f(2, 5)}, {}),
    "Clip": (helper.make_node("Clip", ["x", "lo", "hi"], ["y"]), {"x": _f(2, 5)},
             {"lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)}),
    "Mod": (helper.make_node("Mod", ["a", "b"], ["y"]), {}, {"a": _i([-7, 7, 5]), "b": _i([3, -3, 2])}),
    "Div": (helper.make_node("Div", ["a", "b"], ["y"]), {}, {"a": _i([-7, 7, 5]), "b": _i([2, -2, 2])}),
    "Tile": (helper.make_node("Tile", ["x", "r"], ["y"]), {"x": _f(2, 3)}, {"r": _i([2, 1])}),
    "Split": (helper.make_node("Split", ["x"], ["y", "z"], axis=1, num_outputs=2), {"x": _f(2, 5)}, {}),
    "ReduceSum": (helper.make_node("ReduceSum", ["x", "a"], ["y"], keepdims=0), {"x": _f(2, 3, 4)}, {"a": _i([1])}),
    "ReduceMax": (helper.make_node("ReduceMax", ["x", "a"], ["y"]), {"x": _f(2, 3, 4)}, {"a": _i([-1])}),
    "Gemm": (helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1, alpha=0.5, beta=2.0),
             {"a": _f(4, 3), "b": _f(5, 4, seed=1), "c": _f(5, seed=2)}, {}),
    "Flatten": (helper.make_node("Flatten", ["x"], ["y"], axis=2), {"x": _f(2, 3, 4, 5)}, {}),
    "Slice": (helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"]), {"x": _f(4, 6)},
              {"s": _i([-1, 1]), "e": _i([-10, 100]), "a": _i([0, 1]), "st": _i([-2, 2])}),
    "SimplifiedLayerNormalization": (
        helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y"], epsilon=1e-5, axis=-1),
        {"x": _f(2, 3, 8), "s": _f(8, seed=1)}, {}),
    "LayerNormalization": (helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5),
                           {"x": _f(2, 3, 8), "s": _f(8, seed=1), "b": _f(8, seed=2)}, {}),
    "Expand": (helper.make_node("Expand", ["x", "s"], ["y"]), {"x": _f(3, 1)}, {"s": _i([2, 1, 4])}),
    # the dynamo exporter's mask lookup: padding_mask[batch_idx, kv_idx]
    "GatherND": (helper.make_node("GatherND", ["x", "i"], ["y"]), {"x": _f(3, 4, 5)},
                 {"i": _i([[[0, 1], [2, -1]], [[1, 3], [-3, 0]]])}),
    "GatherND-batch_dims": (helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=1), {"x": _f(2, 3, 4)},
                            {"i": _i([[[1], [0]], [[2], [-1]]])}),
    "ScatterND": (helper.make_node("ScatterND", ["x", "i", "u"], ["y"]), {"x": _f(4, 3), "u": _f(2, 3, seed=1)},
                  {"i": _i([[2], [0]])}),
    "ScatterND-add": (helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="add"),
                      {"x": _f(3, 4), "u": _f(3, seed=1)}, {"i": _i([[0, 1], [2, 3], [0, 1]])}),
    "ScatterND-mul": (helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="mul"),
                      {"x": _f(3, 4, 2), "u": _f(3, 2, seed=1)}, {"i": _i([[0, 1], [2, 3], [0, 1]])}),
    "ScatterND-max": (helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="max"),
                      {"x": _f(3, 4), "u": _f(2, 4, seed=1)}, {"i": _i([[1], [-1]])}),
    "Where": (helper.make_node("Where", ["c", "x", "z"], ["y"]),
              {"c": _f(2, 3) > 0, "x": _f(2, 3, seed=1), "z": _f(1, 3, seed=2)}, {}),
}


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_operator_matches_onnxruntime(name):
    node, feeds, consts = OP_CASES[name]
    elem = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
            np.dtype(np.bool_): TensorProto.BOOL}
    inputs = [helper.make_tensor_value_info(k, elem[v.dtype], v.shape) for k, v in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output]
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    model = helper.make_model(helper.make_graph([node], "op", inputs, outputs, initializer=inits),
                              opset_imports=[helper.make_opsetid("", 21)])
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    graph = from_proto(model, 21)
    env = {k: torch.from_numpy(v) for k, v in {**feeds, **consts}.items()}
    run_nodes(graph.nodes, env, torch.device("cpu"), 21)
    shapes = infer(graph, {k: v.shape for k, v in feeds.items()})
    for o, w in zip(node.output, want):
        np.testing.assert_allclose(env[o].numpy(), w, atol=1e-5, rtol=1e-5)
        assert shapes[o].shape == w.shape
