"""`hetplan exec` runs plans whose weights are quantised (q8_0, q4_0, int8, int4, q4_k_m).

Each linear weight is stored packed in the plan's format and multiplied by the packed kernels.
For tiny llama and gpt2 models (fp32 checkpoints) the run's logits equal transformers' run with
the weights the packed bytes hold, decoded by ``tests.exec.quant_spec`` from the format
definitions (embedding tables rounded to fp16, the rest untouched): within 1e-4 of the logits'
scale (fp32 arithmetic in both, the kernels accumulating per block of 32; x multiplied in
int8 is ``test_int8_kernels``'s, with its activation-rounding bound), and greedy tokens agree; the quantisation error against the fp32 model is within a bound per format; the emulated
GPU holds no more than the plan plus emulation's fp32 activations. A q4_k_m plan mixing GPU,
streamed and CPU blocks runs too. The formats and kernels themselves are
``test_quant_kernels``'s, quantised MoE plans ``tests.moe``'s, quantised KV caches
``test_kv_quant``'s.
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
from tests.exec import quant_spec

PROMPT_LEN, GEN_LEN, TOL = 8, 8, 1e-4
PROMPT = (tuple(range(3, 3 + PROMPT_LEN)),)
QUANTISATION_ERROR = {"q8_0": 0.04, "int8": 0.04, "q4_0": 0.5, "q4_k_m": 0.6, "int4": 0.9}
"""Bound on |logits - fp32 logits| / |fp32 logits| of the first step, per format: about twice
the error measured on these tiny random models (llama / gpt2: q8_0 2.0 / 1.3%, int8 1.8 / 1.2%,
q4_0 30 / 21%, q4_k_m 39 / 17%, int4 62 / 27%: 4-bit formats on 64-wide random layers). Each
element's rounding is bounded exactly in ``test_quant_kernels``."""


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


def decoded(fmt, w):
    """What the runtime's packed bytes of ``w`` [out, in] hold, decoded from the format's definition."""
    packed = quant.quantise(fmt, w).numpy()
    return torch.from_numpy(quant_spec.decode(fmt, packed, *w.shape)).float()


def dequantised_model(model, spec, fmt):
    """A copy of ``model`` holding what the runtime computes with: linears as their packed bytes
    decode, embedding tables rounded to fp16, the head's weight its own (untied) matrix."""
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
            elif len(t.shape) == 2:
                rows = w.t() if t.local.endswith("_t") else w
                deq = decoded(fmt, rows.contiguous())
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


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_logits_match_transformers_with_dequantised_weights(monkeypatch, setup, family, fmt):
    """The fp32 kernels (x multiplied in int8 has its own bound: ``test_int8_kernels``)."""
    monkeypatch.setenv("HETPLAN_INT8_DECODE", "0")
    monkeypatch.setenv("HETPLAN_INT8_PREFILL", "0")
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
    assert (got - steps).abs().max().item() <= TOL * steps.abs().max().item()
    assert result.tokens == out.sequences[:, PROMPT_LEN:].tolist()
    rel = ((got[0] - exact).norm() / exact.norm()).item()
    assert rel < QUANTISATION_ERROR[fmt]


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
