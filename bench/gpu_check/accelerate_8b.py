"""Accelerate baseline of ``bench/gpu_check.sh``: llama-3.1-8b shaped, bf16, constant weights,
device_map from max_memory {0: 9GiB}; decode seconds per token from the gaps between logits."""

import json, sys, time, torch, transformers
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from hetplan.frontends.resolve import load_model
spec = load_model("llama-3.1-8b", "bf16")
cfg = transformers.LlamaConfig(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                               num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
                               num_key_value_heads=spec.n_kv_heads, vocab_size=spec.vocab,
                               max_position_embeddings=spec.max_positions, rope_theta=spec.rope_theta,
                               tie_word_embeddings=spec.tie_embeddings)
with init_empty_weights():
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.to_empty(device="cpu")
with torch.no_grad():  # constant weights: decode speed does not depend on the values
    for name, p in model.named_parameters():
        p.fill_(1.0 if "norm" in name else 0.01)
for name, m in list(model.named_modules()):  # rotary tables are buffers to_empty left unset
    if name.endswith("rotary_emb"):
        setattr(model.get_submodule(name.rsplit(".", 1)[0]), "rotary_emb", type(m)(config=cfg))
model.eval()
device_map = infer_auto_device_map(model, max_memory={0: "9GiB", "cpu": "100GiB"},
                                   no_split_module_classes=["LlamaDecoderLayer"])
model = dispatch_model(model, device_map=device_map)
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0

class Stamp(transformers.LogitsProcessor):
    def __init__(self): self.t = []
    def __call__(self, ids, scores): self.t.append(time.perf_counter()); return scores

ids = torch.randint(0, spec.vocab, (1, 512), device="cuda")
stamp = Stamp()
with torch.inference_mode():
    model.generate(ids, max_new_tokens=24, do_sample=False, logits_processor=[stamp],
                   attention_mask=torch.ones_like(ids))
gaps = [b - a for a, b in zip(stamp.t, stamp.t[1:])]
on_gpu = sum(1 for d in device_map.values() if d == 0)
json.dump({"tpot_s": sum(gaps) / len(gaps), "modules_on_gpu": on_gpu, "modules": len(device_map)},
          open(sys.argv[1], "w"))
