"""Bad ONNX input is a one-line error (exit code 2) that says what is wrong, never a traceback."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hetplan.cli import main  # noqa: E402
from hetplan.errors import HetplanError  # noqa: E402
from hetplan.frontends.onnx.importer import spec_from_onnx  # noqa: E402


def _compile(path, capsys, tmp_path) -> str:
    rc = main(["compile", str(path), "--hw", "rtx4090-64g", "-o", str(tmp_path / "plan.json"),
               "--prompt-len", "4", "--gen-len", "2"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.count("\n") == 1
    return err


def _tiny_graph(nodes, opset=17, inits=(), domain_opsets=()):
    """input_ids [batch, seq] int64 -> ... -> logits, with the given nodes and initializers."""
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializer=list(inits))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in domain_opsets]
    return helper.make_model(g, opset_imports=imports)


def _embedding(vocab=16, hidden=8):
    rng = np.random.default_rng(0)
    return numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "embed.weight")


def test_random_bytes_are_not_an_onnx_model(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x00\xffthis is not a protobuf" * 10)
    err = _compile(path, capsys, tmp_path)
    assert "model.onnx" in err and ("not a readable ONNX model" in err or "no graph nodes" in err)


def test_a_truncated_export_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.onnx.exports import export
    src, _, _ = export("llama", False)
    data = src.read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    err = _compile(path, capsys, tmp_path)
    assert "cut.onnx" in err and ("truncated" in err or "not a readable ONNX model" in err)


def _with_external_data(tmp_path):
    pytest.importorskip("transformers")
    from tests.onnx.exports import export
    src, _, _ = export("gpt2", True)
    model = onnx.load(str(src))
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.weights", size_threshold=256)
    return path, tmp_path / "ext.weights"


def test_missing_external_data_file_is_named(tmp_path, capsys):
    path, weights = _with_external_data(tmp_path)
    assert spec_from_onnx(path).n_layers == 2
    weights.unlink()
    err = _compile(path, capsys, tmp_path)
    assert "ext.weights" in err and "missing" in err


def test_truncated_external_data_file_is_named(tmp_path, capsys):
    path, weights = _with_external_data(tmp_path)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    err = _compile(path, capsys, tmp_path)
    assert "ext.weights" in err and "truncated" in err


def test_opset_outside_the_supported_range_is_refused(tmp_path, capsys):
    model = _tiny_graph([helper.make_node("Gather", ["embed.weight", "input_ids"], ["logits"])],
                        opset=11, inits=[_embedding()])
    path = tmp_path / "old.onnx"
    onnx.save(model, str(path))
    err = _compile(path, capsys, tmp_path)
    assert "opset 11" in err and "13..23" in err


def test_unsupported_operator_is_refused_with_its_node_and_opset(tmp_path, capsys):
    k = numpy_helper.from_array(np.array([2], dtype=np.int64), "k")
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"], name="embed"),
             helper.make_node("TopK", ["h", "k"], ["logits", "idx"], name="my_topk"),
             helper.make_node("FusedMatMul", ["h", "h"], ["unused"], name="fused", domain="com.microsoft")]
    model = _tiny_graph(nodes, inits=[_embedding(), k], domain_opsets=[("com.microsoft", 1)])
    path = tmp_path / "topk.onnx"
    onnx.save(model, str(path))
    err = _compile(path, capsys, tmp_path)
    assert "TopK (node 'my_topk', opset 17)" in err
    assert "com.microsoft::FusedMatMul (node 'fused', opset 1)" in err


def test_fused_opset_23_attention_is_refused_with_the_opset_to_export_at(tmp_path, capsys):
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"], name="embed"),
             helper.make_node("Attention", ["h", "h", "h"], ["logits"], name="sdpa")]
    model = _tiny_graph(nodes, opset=23, inits=[_embedding()])
    path = tmp_path / "attention.onnx"
    onnx.save(model, str(path))
    err = _compile(path, capsys, tmp_path)
    assert "Attention (node 'sdpa', opset 23)" in err
    assert "opset_version=20" in err and "Traceback" not in err


def test_graph_without_decoder_layers_is_refused_with_the_reason(tmp_path, capsys):
    w = numpy_helper.from_array(np.ones((8, 16), dtype=np.float32), "proj.weight")
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"]),
             helper.make_node("MatMul", ["h", "proj.weight"], ["logits"])]
    path = tmp_path / "bag.onnx"
    onnx.save(_tiny_graph(nodes, inits=[_embedding(), w]), str(path))
    err = _compile(path, capsys, tmp_path)
    assert "no recognisable decoder layers" in err and "0 residual addition" in err


def test_graph_without_a_token_embedding_is_refused(tmp_path):
    nodes = [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)]
    path = tmp_path / "cast.onnx"
    onnx.save(_tiny_graph(nodes), str(path))
    with pytest.raises(HetplanError, match="no token embedding found"):
        spec_from_onnx(path)


def test_a_model_file_moved_after_compiling_is_found_again_with_its_hash(tmp_path):
    pytest.importorskip("transformers")
    from tests.onnx.exports import export
    from hetplan.compiler import CompileRequest, compile_plan
    from hetplan.frontends.onnx.importer import with_onnx_file
    src, _, _ = export("llama", True)
    copy = tmp_path / "copy.onnx"
    shutil.copy(src, copy)
    plan, _ = compile_plan(CompileRequest(model=str(copy), hw="rtx4090-64g", prompt_len=4, gen_len=2))
    moved = tmp_path / "moved.onnx"
    copy.rename(moved)
    assert with_onnx_file(plan, moved).model.extra["onnx_path"] == str(moved.resolve())
    other, _, _ = export("gpt2", True)
    with pytest.raises(HetplanError, match="not the ONNX file the plan was compiled from"):
        with_onnx_file(plan, other)


def test_a_shape_that_depends_on_token_values_cannot_be_planned():
    from hetplan.frontends.onnx.ir import from_proto
    from hetplan.frontends.onnx.shapes import infer
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"]),
             helper.make_node("Reshape", ["h", "input_ids"], ["logits"], name="reshape_by_ids")]
    graph = from_proto(_tiny_graph(nodes, inits=[_embedding()]), 17)
    with pytest.raises(HetplanError, match="'reshape_by_ids'.*depends on the input data"):
        infer(graph, {"input_ids": (1, 2)})
