"""`hetplan exec` on a GGUF file computes what transformers computes on the same file.

The oracle is transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``, which
dequantises every tensor to fp32 with the ``gguf`` package), on tiny files with mixed types per
tensor. Where the runtime holds the file's values exactly (Q8_0, Q4_0, F16, BF16, F32), the logits
of the prefill (every position) and of every decode step agree within 1e-4 of the logits'
scale, and greedy decoding yields the same tokens, under plans that keep everything on the
(emulated) GPU, stream it, or compute part of it on the CPU. Where it converts (Q4_K -> q4_k_m,
Q6_K -> q8_0, an fp16 embedding table), each logit z_i moves by at most, to first order,
sum over weights w of |dz_i/dw| * eps_w, eps_w the per-weight bound of the conversion
(``tests.gguf.test_weights.oracle``, derived from the formats); the gradient is transformers'
own (autograd), and twice that sum covers the higher-order terms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader
from gguf.quants import dequantize

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.session import RunOptions, run_plan
from tests.gguf.files import Dims, write_model
from tests.gguf.test_weights import oracle, reverse_permute

PROMPT_LEN, GEN_LEN, REL_TOL = 8, 8, 1e-4
EXACT = {"token_embd.weight": "F16", "attn_q.weight": "Q4_0", "attn_k.weight": "Q8_0", "attn_v.weight": "F16",
         "attn_output.weight": "Q8_0", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_0", "ffn_down.weight": "Q8_0",
         "blk.1.ffn_down.weight": "BF16", "output.weight": "Q8_0", "ffn_gate_exps.weight": "Q4_0",
         "ffn_up_exps.weight": "Q4_0", "ffn_down_exps.weight": "Q8_0", "blk.0.attn_v.weight": "Q4_0"}
KQUANT = {"token_embd.weight": "Q4_K", "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K",
          "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K",
          "ffn_down.weight": "Q6_K", "output.weight": "Q6_K", "blk.1.attn_q.weight": "Q8_0"}


def reference_model(path, arch: str):
    # transformers reads no expert width from a qwen3moe file (its default, 768, would not fit)
    extra = {"moe_intermediate_size": 256} if arch == "qwen3moe" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32, **extra).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run(path, node, strategy: str, ids, gpu_mem=None):
    # an fp32 KV cache, as transformers keeps it (a GGUF plan's default is llama.cpp's fp16)
    req = CompileRequest(model=str(path), hw=node, strategy=strategy, prompt_len=PROMPT_LEN, gen_len=GEN_LEN,
                         gpu_mem=gpu_mem, kv_dtype="fp32")
    plan = compile_plan(req)[0]
    result = run_plan(plan, RunOptions(weights=str(path), prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN,
                                       all_logits=True, keep_logits=True, emulate=True))
    return plan, result


@pytest.fixture(scope="module", params=["llama", "qwen3moe"])
def exact_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    write_model(path, request.param, EXACT, seed=11)
    model = reference_model(path, request.param)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(5))
    ref = greedy_reference(model, ids)
    top2 = ref["steps"].topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "fixture too close to a greedy tie"
    return path, ids, ref


def greedy_reference(model, ids, gen_len: int = GEN_LEN) -> dict:
    """transformers' logits at every prompt position (``prefill``), at each of ``gen_len`` greedy
    steps (``steps``), and the tokens it generates."""
    with torch.no_grad():
        full = model(ids).logits
        out = model.generate(ids, max_new_tokens=gen_len, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    return {"prefill": full, "steps": torch.stack(out.logits), "tokens": out.sequences[:, ids.shape[1]:].tolist()}


PLANS = {"all-gpu": ("all-gpu", None, {"gpu"}), "stream": ("stream", None, {"stream"}),
         "ngl": ("ngl:1", None, {"gpu", "cpu"})}


@pytest.mark.parametrize("plan_name", PLANS)
def test_exact_types_match_transformers(exact_file, node, plan_name):
    path, ids, ref = exact_file
    strategy, gpu_mem, needs = PLANS[plan_name]
    plan, result = run(path, node, strategy, ids, gpu_mem)
    assert needs <= {p["exec"][ph] for p in plan.placement for ph in ("prefill", "decode")}
    scale = ref["prefill"].abs().max().item()
    prefill = result.logits[0]
    assert prefill.shape == ref["prefill"].shape
    assert (prefill - ref["prefill"]).abs().max().item() <= REL_TOL * scale
    steps = torch.stack([result.logits[0][:, -1]] + result.logits[1:])
    assert (steps - ref["steps"]).abs().max().item() <= REL_TOL * scale
    assert result.tokens == ref["tokens"]


def test_converted_types_stay_within_the_derived_bound(tmp_path, node):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", KQUANT, seed=12)
    model = reference_model(path, "llama")
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(6))
    plan, result = run(path, node, "all-gpu", ids)
    reader = GGUFReader(str(path))
    params = dict(model.named_parameters())
    eps = {n: torch.from_numpy(np.ascontiguousarray(oracle(reader, n, plan.model)[1])) for n in params}
    z = model(ids).logits[0, -1]                                      # [V], last prompt position
    bound = torch.empty_like(z)
    for i in range(z.shape[0]):
        grads = torch.autograd.grad(z[i], list(params.values()), retain_graph=True)
        bound[i] = sum((g.abs() * eps[n]).sum() for n, g in zip(params, grads))
    got = result.logits[0][0, -1]
    diff = (got - z.detach()).abs()
    assert (diff <= 2 * bound + 1e-6 * z.abs().max()).all(), float((diff - 2 * bound).max())
    assert bound.max() > 0 and diff.max() > 0                        # the conversion did round


def mixtral_from_file(path, dims: Dims):
    """transformers' Mixtral with the file's weights: transformers reads no llama-MoE GGUF, so
    the state dict is built here from ``gguf.quants.dequantize`` (q/k rows un-permuted as
    llama.cpp's converter documents; experts stacked as transformers holds them)."""
    config = transformers.MixtralConfig(hidden_size=dims.hidden, intermediate_size=dims.ffn,
                                        num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                                        num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim,
                                        vocab_size=dims.vocab, num_local_experts=dims.experts,
                                        num_experts_per_tok=dims.experts_used, rms_norm_eps=1e-5,
                                        rope_theta=10000.0, max_position_embeddings=dims.context)
    model = transformers.MixtralForCausalLM(config).eval()
    t = {x.name: dequantize(np.array(x.data), x.tensor_type).astype(np.float32) for x in GGUFReader(str(path)).tensors}
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"],
          "lm_head.weight": t["output.weight"]}
    for l in range(dims.layers):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        sd |= {p + "self_attn.q_proj.weight": reverse_permute(t[b + "attn_q.weight"], dims.heads),
               p + "self_attn.k_proj.weight": reverse_permute(t[b + "attn_k.weight"], dims.kv_heads),
               p + "self_attn.v_proj.weight": t[b + "attn_v.weight"],
               p + "self_attn.o_proj.weight": t[b + "attn_output.weight"],
               p + "mlp.gate.weight": t[b + "ffn_gate_inp.weight"],
               p + "mlp.experts.gate_up_proj": np.concatenate([t[b + "ffn_gate_exps.weight"],
                                                               t[b + "ffn_up_exps.weight"]], axis=1),
               p + "mlp.experts.down_proj": t[b + "ffn_down_exps.weight"],
               p + "input_layernorm.weight": t[b + "attn_norm.weight"],
               p + "post_attention_layernorm.weight": t[b + "ffn_norm.weight"]}
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    return model


def test_llama_moe_file_matches_transformers_mixtral(tmp_path, node):
    path = tmp_path / "mx.gguf"
    dims = Dims(ffn=256)
    write_model(path, "llama", EXACT, dims=dims, seed=13, moe=True)
    model = mixtral_from_file(path, dims)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(ids).logits
    plan, result = run(path, node, "all-gpu", ids)
    assert plan.model.arch == "mixtral"
    assert (result.logits[0] - ref).abs().max().item() <= REL_TOL * ref.abs().max().item()
