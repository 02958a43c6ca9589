"""`hetplan exec` runs plans whose weights are quantised (q8_0, q4_0, int8, int4, q4_k_m).

Each linear weight is stored packed in the plan's format (byte sizes derived by hand from the
format definitions below) and dequantised per stage into fp32 on the CPU. For tiny llama and gpt2
models (fp32 checkpoints) the run's logits equal transformers' run with the dequantised weights
(embedding tables rounded to fp16, the rest untouched), greedy tokens agree, the quantisation
error against the fp32 model is small, and the emulated GPU holds no more than the plan plus
emulation's fp32 activations (the plan reserves the dequantisation buffer and counts the fp16
embedding tables). A q4_k_m plan mixing GPU, streamed and CPU blocks runs too. Quantised MoE
plans are `test_exec_quant_moe`'s, quantised KV caches `test_exec_kv_quant`'s.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tests.exec.test_numerics import GPU_NODE, save_tiny_model

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.dtypes import DEQUANT_BYTES
from hetplan.evaluate import make_plan
from hetplan.graph import dequant_buffer_elems, workspace_bytes
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.runtime.kernels import quant
from hetplan.runtime.backend import backend_for
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.workload import Workload

PROMPT_LEN, GEN_LEN, TOL = 8, 8, 1e-4
PROMPT = (tuple(range(3, 3 + PROMPT_LEN)),)
BITS = {"q8_0": 34 * 8 / 32, "q4_0": 18 * 8 / 32, "q4_k_m": 156 * 8 / 256}
"""Bits per weight of the block formats, from their byte layouts (whole blocks)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    (d / "gpu.yaml").write_text(GPU_NODE)
    models = {fam: save_tiny_model(fam, d / fam) for fam in ("llama", "gpt2")}
    return d, models


def compiled(d, family, fmt, strategy="all-gpu", gpu_mem=None):
    req = CompileRequest(model=str(d / family), hw=str(d / "gpu.yaml"), strategy=strategy, weight_dtype=fmt,
                         kv_dtype="fp32", gpu_mem=gpu_mem, prompt_len=PROMPT_LEN, gen_len=GEN_LEN)
    return compile_plan(req)[0]


def dequantised_model(model, spec, fmt):
    """A copy of ``model`` holding what the runtime computes with: linears quantised and
    dequantised, embedding tables rounded to fp16, the head's weight its own (untied) matrix."""
    backend = backend_for(spec)
    ref = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    head = None
    kinds = [("embed", None), ("head", None)] + [(k, l) for l in range(spec.n_layers) for k in ("attn", "mlp")]
    for kind, layer in kinds:
        for t in backend.block_tensors(kind, kind, layer):
            name = t.checkpoint if t.checkpoint in state else t.checkpoint.split(".", 1)[1]
            w = model.state_dict()[name]
            if t.local in quant.EMBEDDINGS:
                state[name] = w.half().float()
            elif quant.quantises(t.local, t.shape):
                rows = w.t() if t.local.endswith("_t") else w
                deq = quant.dequantise(fmt, quant.quantise(fmt, rows), rows.shape, torch.empty(rows.shape))
                deq = deq.t() if t.local.endswith("_t") else deq
                if kind == "head":
                    head = deq
                else:
                    state[name] = deq
    if spec.tie_embeddings:  # the tied alias would overwrite the rounded embedding table
        state.pop("lm_head.weight", None)
    ref.load_state_dict(state, strict=False)
    ref.lm_head.weight = torch.nn.Parameter(head)      # untied from the (fp16) embedding table
    return ref


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("shape", [(64, 64), (96, 64), (7, 33)])
def test_packed_sizes_follow_the_format_definitions(fmt, shape):
    out, inp = shape
    n = out * inp
    expected = {"q8_0": 34 * -(-n // 32), "q4_0": 18 * -(-n // 32), "int8": out * inp + 4 * out,
                "int4": -(-n // 2) + 4 * out, "q4_k_m": 156 * -(-n // 256)}[fmt]
    w = torch.randn(shape)
    assert quant.quantise(fmt, w).numel() == expected == quant.nbytes(fmt, shape)


def test_formats_are_priced_at_their_rates():
    assert BITS["q4_k_m"] == 156 * 8 / 256 and BITS["q8_0"] == 8.5 and BITS["q4_0"] == 4.5


@pytest.mark.parametrize("fmt,qmax", [("q8_0", 127), ("int8", 127), ("q4_0", 7), ("int4", 7), ("q4_k_m", 7.5)])
def test_dequantised_error_is_at_most_half_a_step(fmt, qmax):
    """Symmetric formats round to steps of max|x| / qmax; q4_k_m to steps of range / 15 plus
    the min's 8-bit rounding."""
    w = torch.randn(16, 64)
    deq = quant.dequantise(fmt, quant.quantise(fmt, w), w.shape, torch.empty(w.shape))
    step = w.abs().max() / qmax
    assert (deq - w).abs().max() <= step * 0.55 + 1e-6


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_logits_match_transformers_with_dequantised_weights(setup, family, fmt):
    d, models = setup
    plan = compiled(d, family, fmt)
    result = run_plan(plan, RunOptions(weights=str(d / family), prompt_ids=PROMPT, gen_len=GEN_LEN,
                                       keep_logits=True, emulate=True))
    ids = torch.tensor(PROMPT)
    ref = dequantised_model(models[family], plan.model, fmt)
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=GEN_LEN, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
        exact = models[family](ids).logits[:, -1]
    steps = torch.stack(out.logits)                               # [G, B, V]
    got = torch.stack(result.logits)
    assert (got - steps).abs().max().item() <= TOL
    assert result.tokens == out.sequences[:, PROMPT_LEN:].tolist()
    # Quantisation error against the fp32 model: a loose sanity bound on the first logits.
    rel = ((got[0] - exact).norm() / exact.norm()).item()
    assert rel < (0.05 if fmt in ("q8_0", "int8") else 1.0)


def activation_allowance(plan) -> float:
    """What emulation may hold beyond the plan: its activations are fp32 where the plan counts
    16-bit ones, i.e. one more GPU workspace less its dequantisation buffer (which the plan
    reserves, and the emulated ledger charges, at bf16 size)."""
    spec = plan.model
    return workspace_bytes(spec, plan.workload, "gpu") - dequant_buffer_elems(spec) * DEQUANT_BYTES["gpu"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k_m"])
def test_emulated_gpu_peak_is_the_plan_plus_fp32_activations(setup, family, fmt):
    """The dequantisation buffer and the fp16 embedding tables are in the plan; the only
    allowance left is emulation's fp32 activations."""
    d, _ = setup
    plan = compiled(d, family, fmt)
    result = run_plan(plan, RunOptions(weights=str(d / family), prompt_ids=PROMPT, gen_len=GEN_LEN, emulate=True))
    assert result.peak_bytes["gpu"] <= plan.memory["gpu_bytes"] + activation_allowance(plan)


def test_q4_k_m_plan_mixing_gpu_stream_and_cpu_blocks_runs(setup):
    """A decision holding resident, streamed and CPU-computed blocks, CPU-side KV caches and a
    two-slot staging ring, priced at q4_k_m: logits equal the all-GPU run's."""
    d, _ = setup
    spec = load_model(str(d / "llama"), "q4_k_m", "fp32")
    problem = build_problem(spec, load_node(str(d / "gpu.yaml")), Workload(1, PROMPT_LEN, GEN_LEN))
    weights = {"embed": "cpu", "attn_0": "gpu", "mlp_0": "stream", "attn_1": "stream", "mlp_1": "cpu",
               "head": "stream"}
    exec_ = {"prefill": dict(weights), "decode": dict(weights, mlp_0="cpu")}
    dec = Decision(weights=weights, exec=exec_, kv={"attn_0": "cpu", "attn_1": "cpu"}, depth=2)
    plan = make_plan(problem, dec, {"strategy": "hand", "status": "heuristic", "mip_gap": None, "options": {}})
    result = run_plan(plan, RunOptions(weights=str(d / "llama"), prompt_ids=PROMPT, gen_len=GEN_LEN,
                                       keep_logits=True, emulate=True))
    ref = run_plan(compiled(d, "llama", "q4_k_m"), RunOptions(weights=str(d / "llama"), prompt_ids=PROMPT,
                                                              gen_len=GEN_LEN, keep_logits=True, emulate=True))
    assert (torch.stack(result.logits) - torch.stack(ref.logits)).abs().max().item() <= TOL
    assert result.tokens == ref.tokens
