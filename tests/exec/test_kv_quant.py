"""`hetplan exec` runs plans whose KV caches are quantised (``--kv-dtype`` q8_0 q4_0 int8 int4 q4_k_m).

Each token's cached row (a layer's K or V over all KV heads; DeepSeek's latent or rope key) is
stored in the plan's format, as the planner prices it up to padding to whole blocks (int8/int4:
plus one fp32 scale per row, which the planner leaves out). The prompt attends over its exact
K/V; every later step attends over the cache, dequantised.

Oracle: transformers with the same fp32 weights, its cache patched to store each token's K/V
row (after RoPE, as the cache holds it) quantised and dequantised by a numpy re-implementation
of the format's definition (q8_0/q4_0: the ``gguf`` package's reference quantisers), and to
hand the prompt's own forward the exact values. Quantising
is discontinuous: the 1e-7 rounding differences between two fp32 implementations now and then
move a value across a rounding boundary, a whole quantisation step apart. So the oracle
quantises the rows the runtime wrote, after checking that they are transformers' own (within
1e-5); the runtime's dequantised cache must equal the numpy result exactly. Tiny llama (GQA) and
DeepSeek-V3 (latent attention) models, caches on the (emulated) GPU or in DRAM (decode attention
on the CPU, the prompt's KV quantised on the GPU and copied down): logits within 1e-4 of the
oracle's and the same greedy tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
import transformers.cache_utils
from tests.moe.test_whole_blocks import FAMILIES
from tests.exec.test_numerics import save_tiny_model
from tests.tiny_models import TINY_GPU_NODE, randomise_moe

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.dtypes import BITS_PER_ELEMENT
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.problem import build_problem
from hetplan.runtime import kv_cache
from hetplan.runtime.backend import backend_for
from hetplan.runtime.devices import Devices
from hetplan.runtime.residency import Residency
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.runtime.weights import RandomWeights
from hetplan.solvers import baselines
from hetplan.workload import Workload

PROMPT_LEN, GEN_LEN, TOL, VOCAB = 8, 16, 1e-4, 128
ORACLE_FORMATS = ("q8_0", "int8", "q4_0")
MODES = ["emulated", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device"))]


# -- the formats, from their definitions (runtime/kernels/quant.py's docstring) ------------------------------
def fake_quantised(fmt: str, rows: np.ndarray) -> np.ndarray:
    """rows [M, n] fp32, each quantised on its own and dequantised: q8_0/q4_0 by the ``gguf``
    package's reference quantiser and dequantiser (the row zero-padded to whole blocks of 32);
    int8 with one fp32 scale d = max|x| / 127 per row, q = round half to even (x / d), clipped
    to [-127, 127]; returns q * d."""
    m, n = rows.shape
    if fmt in ("q8_0", "q4_0"):
        gguf = pytest.importorskip("gguf")
        padded = np.zeros((m, -(-n // 32) * 32), np.float32)
        padded[:, :n] = rows
        qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
        return gguf.dequantize(gguf.quantize(padded, qtype), qtype).astype(np.float32)[:, :n]
    d = (np.abs(rows).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = np.clip(np.round(rows / np.where(d == 0, np.float32(1), d)), -127, 127)
    return q * d


def _fake_quantised_rows(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] (the runtime's layout) with each token's row fake-quantised."""
    b, n = x.shape[:2]
    return torch.from_numpy(fake_quantised(fmt, x.reshape(b * n, -1).numpy())).view(x.shape)


def _oracle_update(fmt: str, written: dict, names: tuple):
    """``Cache.update`` for transformers: layer l's new states (keys, values: [B, heads, S, d])
    are checked against the rows the runtime wrote (``written[l, name]``: [B, T, ...]) and
    those, fake-quantised, are stored; the first call (the prompt) returns the exact states,
    later ones everything stored."""
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[layer_idx]
        first = not layer.is_initialized
        if first:
            layer.lazy_initialization(key_states, value_states)
        start, (b, _, n, _) = 0 if first else layer.keys.shape[-2], key_states.shape
        stored = []
        for states, name in zip((key_states, value_states), names):
            rows = written[layer_idx, name][:, start:start + n]                     # [B, S, ...]
            theirs = states.transpose(1, 2).reshape(b, n, -1)
            assert (rows.reshape(b, n, -1) - theirs).abs().max().item() <= 1e-5, "the runtime wrote other rows"
            stored.append(_fake_quantised_rows(fmt, rows).reshape(b, n, states.shape[1], -1).transpose(1, 2))
        layer.keys = torch.cat([layer.keys, stored[0]], dim=-2)
        layer.values = torch.cat([layer.values, stored[1]], dim=-2)
        return (key_states, value_states) if first else (layer.keys, layer.values)
    return update


def _run_recording(plan, model_dir: str, ids: torch.Tensor, mode: str):
    """Run ``plan``, recording each cache row the runtime writes before quantising it ->
    (result, {(layer, name): [B, T, ...] fp32 rows}, {(layer, name): the cache value})."""
    rows, residencies = {}, []
    write, init = kv_cache.write, Residency.__init__

    def record(value, start, x, non_blocking=False):
        for i in range(x.shape[1]):
            rows.setdefault(id(value), {})[start + i] = x[:, i].float().cpu()
        write(value, start, x, non_blocking)

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        residencies.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache, "write", record)
        mp.setattr(Residency, "__init__", keep)
        result = run_plan(plan, RunOptions(weights=model_dir, prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN,
                                           all_logits=True, keep_logits=True, emulate=mode == "emulated"))
    written, values = {}, {}
    for block, cache in residencies[0].kv.items():
        for name, value in cache.items():
            key = (int(block.split("_")[1]), name)
            values[key] = value
            written[key] = torch.stack([row for _, row in sorted(rows[id(value)].items())], dim=1)
    return result, written, values


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "node.yaml"
    path.write_text(TINY_GPU_NODE)
    return str(path)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def family_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        model = save_tiny_model("llama", directory)
    else:
        config_cls, model_cls, kw = FAMILIES[request.param]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw)).eval()
        randomise_moe(model)
        model.save_pretrained(directory)
    ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    return request.param, str(directory), model, ids


def _plan(model_dir: str, node: str, kv_dtype: str, where: str):
    """Everything resident on the GPU; the KV caches there too (``gpu``) or in DRAM (``dram``:
    decode attention on the CPU, the prompt's KV copied down)."""
    if where == "gpu":
        req = CompileRequest(model=model_dir, hw=node, strategy="all-gpu", weight_dtype="fp32", kv_dtype=kv_dtype,
                             prompt_len=PROMPT_LEN, gen_len=GEN_LEN)
        return compile_plan(req)[0]
    spec = load_model(model_dir, "fp32", kv_dtype)
    problem = build_problem(spec, load_node(node), Workload(1, PROMPT_LEN, GEN_LEN))
    dec = baselines.all_gpu(problem)
    dec = dataclasses.replace(dec, kv={b.name: "cpu" for b in problem.blocks if b.kind == "attn"})
    plan = make_plan(problem, dec, {"strategy": "test", "status": "heuristic"})
    assert any(t.kind == "kv_down" for t in plan.schedule["prefill"].tasks)
    assert any(t.kind == "attn_core" and t.resource == "cpu" for t in plan.schedule["decode"].tasks)
    return plan


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["gpu", "dram"])
@pytest.mark.parametrize("fmt", ORACLE_FORMATS)
def test_logits_match_transformers_with_a_fake_quantised_cache(family_model, node, fmt, where, mode):
    _, model_dir, model, ids = family_model
    plan = _plan(model_dir, node, fmt, where)
    assert {p["kv"] for p in plan.placement if p["kv"]} == {"gpu" if where == "gpu" else "cpu"}
    result, written, values = _run_recording(plan, model_dir, ids, mode)
    assert result.mode == mode
    tokens = PROMPT_LEN + GEN_LEN - 1
    for key, value in values.items():
        assert written[key].shape[1] == tokens
        stored = torch.cat([blk for _, blk in kv_cache.read_blocks(value, tokens, torch.float32)], dim=1)
        assert torch.equal(stored.cpu(), _fake_quantised_rows(fmt, written[key]))

    names = tuple(backend_for(plan.model).kv_shapes(1, 1))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(transformers.cache_utils.Cache, "update", _oracle_update(fmt, written, names))
        out = model.generate(ids, max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
        prefill = model(ids).logits
    ref = torch.stack(out.logits)                                                   # [G, B, V]
    top2 = ref.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "fixture too close to a greedy tie"
    assert (result.logits[0] - prefill).abs().max().item() <= TOL
    steps = torch.stack([result.logits[0][:, -1]] + result.logits[1:])
    assert (steps - ref).abs().max().item() <= TOL
    assert result.tokens == out.sequences[:, PROMPT_LEN:].tolist()


@pytest.mark.parametrize("fmt", ORACLE_FORMATS)
def test_a_quantised_cache_changes_decode_but_not_the_prompt(family_model, node, fmt):
    """The prompt attends over its exact K/V, decode over the quantised cache: against an fp32
    cache, prefill logits are equal and decode logits are not (so the oracle above can tell a
    quantised cache from an unquantised one)."""
    _, model_dir, _, ids = family_model
    runs = {}
    for kv in ("fp32", fmt):
        runs[kv] = run_plan(_plan(model_dir, node, kv, "gpu"), RunOptions(
            weights=model_dir, prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN, keep_logits=True, emulate=True))
    exact, quantised = torch.stack(runs["fp32"].logits), torch.stack(runs[fmt].logits)
    assert torch.equal(exact[0], quantised[0])
    assert (exact[1:] - quantised[1:]).abs().max().item() > 100 * TOL


ROW_BYTES = {"q8_0": lambda n: 34 * -(-n // 32), "q4_0": lambda n: 18 * -(-n // 32), "int8": lambda n: n + 4,
             "int4": lambda n: -(-n // 2) + 4, "q4_k_m": lambda n: 156 * -(-n // 256)}
"""Bytes of one quantised row of n values, from the format definitions."""
BLOCK = {"q8_0": 32, "q4_0": 32, "int8": 1, "int4": 2, "q4_k_m": 256}
"""Values a row is padded to a multiple of."""


@pytest.mark.parametrize("fmt", list(ROW_BYTES))
def test_cache_bytes_are_what_the_plan_prices_up_to_whole_blocks(family_model, node, fmt):
    """Per token and layer the runtime holds exactly what the planner prices: each row padded to
    whole blocks with its own scales (the byte counts restated from the format definitions)."""
    _, model_dir, _, _ = family_model
    plan = _plan(model_dir, node, fmt, "dram")
    spec = plan.model
    backend = backend_for(spec)
    batch, tokens = plan.workload.batch, plan.workload.context_len
    rows = {name: int(np.prod(shape[2:])) for name, shape in backend.kv_shapes(batch, tokens).items()}
    assert sum(rows.values()) == spec.kv_elems_per_token()
    residency = Residency(plan, backend, RandomWeights(0), Devices("emulated", plan.memory["gpu_budget_bytes"]),
                          torch.float32, kv_cache.storage(fmt), batch=batch, max_tokens=tokens)
    for p in plan.placement:
        if p["kv"] is None:
            continue
        held = sum(kv_cache.nbytes(v) for v in residency.kv[p["block"]].values())
        assert held == batch * tokens * sum(ROW_BYTES[fmt](n) for n in rows.values())
        assert held == pytest.approx(p["kv_bytes"], abs=1e-6)


def test_kv_dtype_the_runtime_cannot_store_is_refused_naming_the_option_and_the_supported_list():
    with pytest.raises(HetplanError, match="--kv-dtype fp8.*fp32 bf16 fp16 q8_0 q4_0 int8 int4 q4_k_m"):
        kv_cache.storage("fp8")


def test_every_kv_dtype_the_planner_prices_is_stored():
    for name in BITS_PER_ELEMENT:
        kv_cache.storage(name)
