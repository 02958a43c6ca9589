"""`hetplan exec` on a deepseek2 GGUF file (MLA, shared and routed experts, sigmoid routing with
a correction bias, a leading dense layer) computes what transformers' DeepSeek-V3 computes with
the file's weights.

transformers reads no deepseek2 GGUF, so the oracle's state dict is built here from
``gguf.quants.dequantize``: tensors renamed as llama.cpp's converter names them, experts stacked
as transformers holds them, and for a file written the way the converter writes it for llama.cpp's
MLA kernels, ``kv_b_proj`` rebuilt by inverting its split (``attn_k_b`` = W_UK^T [H, r, nope],
``attn_v_b`` = W_UV [H, v, r]). llama.cpp rotates a deepseek2 head's adjacent pairs and its
converter does not permute rows, which is transformers' ``rope_interleave=True``.
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
from tests.gguf.files import MLA, Dims, write_deepseek2
from tests.gguf.test_logits import greedy_reference
from tests.gguf.test_weights import placed

PROMPT_LEN, GEN_LEN, REL_TOL = 8, 6, 1e-4
SEED, SPREAD = 12, 0.2
"""Weights wide enough that attention scores are far from uniform: every MLA weight moves the logits."""
DIMS = Dims(layers=3, hidden=256, ffn=512, heads=4, vocab=256, experts=4, experts_used=2, expert_ffn=64)
TYPES = {"token_embd.weight": "F16", "attn_q_a.weight": "Q4_0", "attn_q_b.weight": "Q8_0",
         "attn_kv_a_mqa.weight": "Q8_0", "attn_kv_b.weight": "F16", "attn_k_b.weight": "Q8_0",
         "attn_v_b.weight": "F16", "attn_output.weight": "Q8_0", "ffn_gate_exps.weight": "Q4_0",
         "ffn_up_exps.weight": "Q4_0", "ffn_down_exps.weight": "Q8_0", "ffn_gate_shexp.weight": "Q8_0",
         "output.weight": "Q8_0"}


def deepseek_from_file(path, dims: Dims):
    m = MLA
    config = transformers.DeepseekV3Config(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.ffn,
        moe_intermediate_size=dims.expert_ffn, num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
        num_key_value_heads=dims.heads, n_shared_experts=m["shared"], n_routed_experts=dims.experts,
        routed_scaling_factor=2.5, kv_lora_rank=m["kv_lora"], q_lora_rank=m["q_lora"], qk_rope_head_dim=m["rope"],
        v_head_dim=m["v"], qk_nope_head_dim=m["nope"], n_group=1, topk_group=1,
        num_experts_per_tok=dims.experts_used, first_k_dense_replace=m["dense"], norm_topk_prob=True,
        rms_norm_eps=1e-6, max_position_embeddings=dims.context, rope_interleave=True)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    t = {x.name: torch.from_numpy(dequantize(np.array(x.data), x.tensor_type).astype(np.float32).copy())
         for x in GGUFReader(str(path)).tensors}
    h, r = dims.heads, m["kv_lora"]
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"],
          "lm_head.weight": t["output.weight"]}
    attn = {"q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
            "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}
    for l in range(dims.layers):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        sd |= {p + f"self_attn.{hf}.weight": t[b + f"{g}.weight"] for hf, g in attn.items()}
        if b + "attn_kv_b.weight" in t:
            sd[p + "self_attn.kv_b_proj.weight"] = t[b + "attn_kv_b.weight"]
        else:   # undo the converter: k_b [H, r, nope] -> [H, nope, r]; then per head [k_b; v_b]
            k_b = t[b + "attn_k_b.weight"].view(h, r, m["nope"]).transpose(1, 2)
            v_b = t[b + "attn_v_b.weight"].view(h, m["v"], r)
            sd[p + "self_attn.kv_b_proj.weight"] = torch.cat((k_b, v_b), dim=1).reshape(-1, r)
        sd |= {p + "input_layernorm.weight": t[b + "attn_norm.weight"],
               p + "post_attention_layernorm.weight": t[b + "ffn_norm.weight"]}
        if l < m["dense"]:
            sd |= {p + f"mlp.{k}_proj.weight": t[b + f"ffn_{k}.weight"] for k in ("gate", "up", "down")}
        else:
            sd |= {p + "mlp.gate.weight": t[b + "ffn_gate_inp.weight"],
                   p + "mlp.gate.e_score_correction_bias": t[b + "exp_probs_b.bias"],
                   p + "mlp.experts.gate_up_proj": torch.cat((t[b + "ffn_gate_exps.weight"],
                                                              t[b + "ffn_up_exps.weight"]), dim=1),
                   p + "mlp.experts.down_proj": t[b + "ffn_down_exps.weight"]}
            sd |= {p + f"mlp.shared_experts.{k}_proj.weight": t[b + f"ffn_{k}_shexp.weight"]
                   for k in ("gate", "up", "down")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=["kv_b", "split"])
def file_and_reference(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ds.gguf"
    write_deepseek2(path, DIMS, TYPES, seed=SEED, split_kv_b=request.param == "split", spread=SPREAD)
    model = deepseek_from_file(path, DIMS)
    ids = torch.randint(0, DIMS.vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    ref = greedy_reference(model, ids, GEN_LEN)
    steps = ref["steps"]
    top2 = steps.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) / steps.abs().max()).min() > 1e-3, "fixture too close to a greedy tie"
    return path, ids, ref


@pytest.mark.parametrize("strategy", ["all-gpu", "stream", "ngl:1"])
def test_deepseek2_file_matches_transformers(file_and_reference, node, strategy):
    path, ids, ref = file_and_reference
    plan = compile_plan(CompileRequest(model=str(path), hw=node, strategy=strategy, prompt_len=PROMPT_LEN,
                                       gen_len=GEN_LEN, kv_dtype="fp32"))[0]
    result = run_plan(plan, RunOptions(weights=str(path), prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN,
                                       all_logits=True, keep_logits=True, emulate=True))
    scale = ref["prefill"].abs().max().item()
    assert (result.logits[0] - ref["prefill"]).abs().max().item() <= REL_TOL * scale
    steps = torch.stack([result.logits[0][:, -1]] + result.logits[1:])
    assert (steps - ref["steps"]).abs().max().item() <= REL_TOL * scale
    assert result.tokens == ref["tokens"]


def test_split_kv_b_is_held_joined_and_decoded_as_planned(tmp_path, node):
    """The pair is priced as one fp32 kv_b (H (nope + v) r values at 4 bytes), not at its file
    types, and the runtime holds exactly the planned bytes."""
    path = tmp_path / "ds.gguf"
    write_deepseek2(path, DIMS, TYPES, split_kv_b=True)
    plan, _, res = placed(path, node)
    blocks = {p["block"]: p for p in plan.placement}
    for p in plan.placement:
        bw = res.blocks[p["block"]]
        assert bw.flat.numel() * bw.flat.element_size() == p["weight_bytes"], p["block"]
    m, d, h = MLA, DIMS.hidden, DIMS.heads
    q8 = lambda rows, cols: rows * cols // 32 * 34                               # noqa: E731
    q4 = lambda rows, cols: rows * cols // 32 * 18                               # noqa: E731
    attn = (4 * d + 4 * m["q_lora"] + 4 * m["kv_lora"]                           # three norms, fp32
            + q4(m["q_lora"], d) + q8(h * (m["nope"] + m["rope"]), m["q_lora"])
            + q8(m["kv_lora"] + m["rope"], d) + q8(d, h * m["v"])
            + 4 * h * (m["nope"] + m["v"]) * m["kv_lora"])                       # kv_b joined, fp32
    assert blocks["attn_1"]["weight_bytes"] == attn
