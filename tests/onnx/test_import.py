"""Planning ONNX exports: blocks are the model's layers, sizes are the model's, costs agree with
the analytic model of the same config."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("onnx")
pytest.importorskip("transformers")

from tests.onnx.exports import EXPORTERS, export  # noqa: E402

from hetplan.cli import main  # noqa: E402
from hetplan.compiler import CompileRequest, compile_plan  # noqa: E402
from hetplan.graph import block_graph  # noqa: E402
from hetplan.hardware import load_node  # noqa: E402
from hetplan.frontends.hf_config import spec_from_config  # noqa: E402
from hetplan.frontends.onnx.graph import onnx_block_graph  # noqa: E402
from hetplan.frontends.onnx.importer import spec_from_onnx  # noqa: E402
from hetplan.problem import build_problem  # noqa: E402
from hetplan.solvers import baselines  # noqa: E402
from hetplan.workload import Workload  # noqa: E402

CASES = [(family, with_past, exporter) for exporter in EXPORTERS for family in ("llama", "gpt2")
         for with_past in (False, True)]
LAYER_PREFIX = {"llama": "model.layers.{l}.", "gpt2": "transformer.h.{l}."}
ATTN_PARTS = {"llama": ("self_attn.", "input_layernorm."), "gpt2": ("attn.", "ln_1.")}


def _numel(shape) -> int:
    return math.prod(shape)


def _size(cfg: dict, key: str) -> int:
    """A size from an HF config dict, under llama's or gpt2's key."""
    gpt2 = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
    return cfg[key] if key in cfg else cfg[gpt2[key]]


def _rotary_bytes(family: str, cfg: dict) -> int:
    """llama's rotary inverse frequencies (head_dim / 2 fp32 floats) are computed once for all
    layers: a constant of the prologue (embed) or of the first attention block, whichever reads
    it first. They are not parameters."""
    return 4 * (cfg["hidden_size"] // cfg["num_attention_heads"] // 2) if family == "llama" else 0


@pytest.mark.parametrize("family,with_past,exporter", CASES)
def test_blocks_are_the_layers_and_hold_their_parameters(family, with_past, exporter):
    path, cfg, params = export(family, with_past, exporter)
    spec = spec_from_onnx(path)
    graph = onnx_block_graph(spec, Workload(batch=1, prompt_len=4, gen_len=2))
    n_layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    expected = ["embed"] + [f"{k}_{l}" for l in range(n_layers) for k in ("attn", "mlp")] + ["head"]
    assert [b.name for b in graph.blocks] == expected
    # Each layer block holds exactly that layer's transformers parameters (fp32: 4 bytes each).
    want = {}
    for l in range(n_layers):
        prefix = LAYER_PREFIX[family].format(l=l)
        layer = {k: v for k, v in params.items() if k.startswith(prefix)}
        attn = sum(_numel(s) for k, s in layer.items() if k[len(prefix):].startswith(ATTN_PARTS[family]))
        want[f"attn_{l}"] = 4 * attn
        want[f"mlp_{l}"] = 4 * (sum(_numel(s) for s in layer.values()) - attn)
    tables = ("embed_tokens.weight", "wte.weight", "wpe.weight")
    want["embed"] = 4 * sum(_numel(s) for k, s in params.items() if k.endswith(tables))
    got = {b.name: b.weight_bytes for b in graph.blocks}
    extra = got["embed"] + got["attn_0"] - want["embed"] - want["attn_0"]
    assert extra == _rotary_bytes(family, cfg)
    assert got["embed"] in (want["embed"], want["embed"] + extra)
    for name in want:
        if name not in ("embed", "attn_0"):
            assert got[name] == want[name], name


@pytest.mark.parametrize("family,with_past,exporter", CASES)
def test_spec_is_read_off_the_graph(family, with_past, exporter):
    path, cfg, _ = export(family, with_past, exporter)
    spec = spec_from_onnx(path)
    hf = spec_from_config(cfg)
    for key in ("n_layers", "hidden", "intermediate", "n_heads", "n_kv_heads", "head_dim", "vocab",
                "norm", "gated_mlp", "pos", "attn_bias", "attn_out_bias", "mlp_bias", "act"):
        assert getattr(spec, key) == getattr(hf, key), key
    assert spec.arch == family and spec.weight_dtype == "fp32"
    assert spec.extra["source"] == "onnx" and spec.extra["with_past"] is with_past
    assert spec.kv_bytes_per_token() == hf.with_dtypes("fp32", "fp32").kv_bytes_per_token()


def _export_flops(family: str, cfg: dict, tokens: int, batch: int, keys: float) -> dict:
    """FLOPs per block of one pass of the export over ``tokens`` new tokens per sequence that
    attend to ``keys`` keys, derived from the config (every product 2 * M * N * K):

    - attn: q/k/v/o projections 2 B T D (2 q_dim + 2 kv_dim), scores q k^T and the weighted sum
      2 * 2 B H T keys head_dim (the export computes the whole masked square);
    - mlp: 2 B T D I per projection (gate, up, down for llama; up, down for gpt2);
    - head: logits at every position, 2 B T D V; the embedding is a lookup, 0."""
    d = _size(cfg, "hidden_size")
    heads = _size(cfg, "num_attention_heads")
    head_dim = d // heads
    kv_dim = cfg.get("num_key_value_heads", heads) * head_dim
    inter = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * d
    bt = batch * tokens
    attn = 2 * bt * d * (2 * heads * head_dim + 2 * kv_dim) + 2 * 2 * batch * heads * tokens * keys * head_dim
    mlp = 2 * bt * d * inter * (3 if family == "llama" else 2)
    out = {"embed": 0.0, "head": 2.0 * bt * d * cfg["vocab_size"]}
    for l in range(_size(cfg, "num_hidden_layers")):
        out[f"attn_{l}"], out[f"mlp_{l}"] = attn, mlp
    return out


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_onnx_block_costs_are_the_exports_exact_bytes_and_flops(family, exporter):
    """Weights and KV per block equal the analytic model's (a norm or bias missing on either side
    would show as its exact size); FLOPs per block and phase equal the hand count of the export's
    products (``_export_flops``): prefill over the prompt, decode one token after the mean cached
    context (``decode_context_len - 1`` past keys plus itself; interpolated costs are affine)."""
    sizes = (dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512) if family == "llama" else dict(n_embd=256, n_head=4, vocab_size=512))
    path, cfg, _ = export(family, True, exporter, **sizes)
    wl = Workload(batch=2, prompt_len=4, gen_len=6)
    onnx_g = onnx_block_graph(spec_from_onnx(path), wl)
    hf_g = block_graph(spec_from_config(cfg).with_dtypes("fp32", "fp32"), wl)
    heads = _size(cfg, "num_attention_heads")
    kv_dim = cfg.get("num_key_value_heads", heads) * (_size(cfg, "hidden_size") // heads)
    rotary = _rotary_bytes(family, cfg)
    for b in hf_g.blocks:
        o = onnx_g.block(b.name)
        assert o.weight_bytes - b.weight_bytes in ((0, rotary) if b.name in ("embed", "attn_0") else (0,)), b.name
        assert o.kv_bytes == b.kv_bytes == (wl.batch * wl.context_len * 2 * kv_dim * 4 if b.kind == "attn" else 0)
    assert sum(b.weight_bytes for b in onnx_g.blocks) == sum(b.weight_bytes for b in hf_g.blocks) + rotary
    want = {"prefill": _export_flops(family, cfg, wl.prompt_len, wl.batch, wl.prompt_len),
            "decode": _export_flops(family, cfg, 1, wl.batch, wl.decode_context_len)}
    for phase in ("prefill", "decode"):
        got = {st.block: st.work.flops for st in onnx_g.stages[phase]}
        assert got == pytest.approx(want[phase], rel=1e-12, abs=0), phase


def test_decode_is_planned_with_the_kv_cache_only_for_with_past_graphs():
    wl = Workload(batch=1, prompt_len=8, gen_len=8)
    with_past = onnx_block_graph(spec_from_onnx(export("llama", True)[0]), wl)
    without = onnx_block_graph(spec_from_onnx(export("llama", False)[0]), wl)
    assert with_past.block("attn_0").kv_bytes == 1 * 16 * (2 * 2 * 16) * 4
    assert without.block("attn_0").kv_bytes == 0
    # Without a cache every decode step recomputes the whole context (about 12.5 tokens here).
    ctx = wl.decode_context_len
    mlp_flops = [st.work.flops for st in without.stages["decode"] if st.block == "mlp_0"][0]
    mlp_flops_cached = [st.work.flops for st in with_past.stages["decode"] if st.block == "mlp_0"][0]
    assert mlp_flops == pytest.approx(ctx * mlp_flops_cached)


def test_compile_cli_plans_an_onnx_model(tmp_path):
    path, _, _ = export("gpt2", True)
    out = tmp_path / "plan.json"
    rc = main(["compile", str(path), "--hw", "rtx4090-64g", "-o", str(out), "--prompt-len", "8",
               "--gen-len", "4", "--gpu-mem", "150KB"])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert [p["block"] for p in plan["placement"]][:3] == ["embed", "attn_0", "mlp_0"]
    assert plan["model"]["extra"]["source"] == "onnx"
    assert plan["solver"]["status"] == "optimal"


def test_stream_baseline_keeps_single_stage_attention_beside_its_cache():
    path, _, _ = export("llama", True)
    spec = spec_from_onnx(path)
    wl = Workload(batch=1, prompt_len=8, gen_len=4)
    hw = load_node("rtx4090-64g")
    graph = onnx_block_graph(spec, wl)
    kv = sum(b.kv_bytes for b in graph.blocks)
    slots = 2 * max(b.weight_bytes for b in graph.blocks if b.streamable)
    problem = build_problem(spec, hw, wl)
    # A GPU that holds the staging slots and workspace but only half the KV caches.
    problem = dataclasses.replace(problem, gpu_budget_bytes=slots + problem.gpu_workspace_bytes + kv / 2)
    dec = baselines.stream(problem)
    for b in graph.blocks:
        if b.kind == "attn":
            assert dec.kv[b.name] == dec.device("decode", b.name) == "cpu"


def test_compile_of_a_too_small_machine_names_the_missing_bytes():
    path, _, _ = export("llama", False)
    req = CompileRequest(model=str(path), hw="rtx4090-64g", prompt_len=8, gen_len=4, gpu_mem="1KB",
                         cpu_mem="1KB", weight_dtype="fp32")
    with pytest.raises(Exception, match="no placement fits"):
        compile_plan(req)
