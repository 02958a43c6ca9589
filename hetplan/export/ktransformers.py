"""A plan as a kTransformers optimize-rule YAML: per MoE layer, routed experts on the CPU
(``KExpertsCPU`` in both phases) or on the GPU (``KExpertsTorch`` for prefill,
``KExpertsMarlin`` for decode), the token embeddings where the plan has them, and every other
module of the layers and the head on the GPU (``KTransformersLinear``), in the format of
kTransformers' own rule files (optimize_rules/DeepSeek-V3-Chat.yaml, Mixtral.yaml): ``match``
(``name`` regex, ``class``) and ``replace`` (``class``, ``kwargs`` with a device and an op per
phase); the first matching rule applies.

What kTransformers can say: which layers' experts live in host memory and run on the CPU; the
embedding's device. It cannot split a layer's experts, stream weights, keep KV caches in host
memory or run attention, dense MLPs or the head on the CPU beside the GPU; a model without
routed experts has nothing for it to offload.
"""

from __future__ import annotations

import yaml

from hetplan.export.regex import layers_regex
from hetplan.export.result import CannotExpress, Export
from hetplan.plan import Plan

EXPERTS_CLASS = "ktransformers.operators.experts.KTransformersExperts"
LINEAR_CLASS = "ktransformers.operators.linear.KTransformersLinear"
ON_CPU = {"prefill_device": "cpu", "prefill_op": "KExpertsCPU", "generate_device": "cpu", "generate_op": "KExpertsCPU",
          "out_device": "cuda"}
ON_GPU = {"prefill_device": "cuda", "prefill_op": "KExpertsTorch", "generate_device": "cuda",
          "generate_op": "KExpertsMarlin", "out_device": "cuda"}
LINEAR = {"generate_device": "cuda", "prefill_device": "cuda", "generate_op": "KLinearMarlin", "prefill_op": "KLinearTorch"}


def experts_module(arch: str) -> str:
    """Where kTransformers' modeling files keep a layer's routed experts (regex-escaped)."""
    return r"block_sparse_moe\.experts" if arch == "mixtral" else r"mlp\.experts"


def emit(plan: Plan) -> Export:
    spec = plan.model
    if not spec.is_moe:
        raise CannotExpress(f"kTransformers offloads routed experts, and {spec.name} has none: it can express no "
                            f"part of this plan; nothing was written")
    if not plan.hardware.gpus:
        raise CannotExpress("kTransformers runs on a GPU and this plan's node has none: it can express no part of "
                            "this plan; nothing was written")
    moe = [p for p in plan.placement if p["kind"] == "moe"]
    cpu = sorted(p["layer"] for p in moe if p["weights"] != "gpu"
                 or (p.get("experts_on_gpu") if p.get("experts_on_gpu") is not None else spec.n_experts) < spec.n_experts)
    gpu = sorted(p["layer"] for p in moe if p["layer"] not in set(cpu))
    where = experts_module(spec.arch)
    rules = []
    for layers, kwargs in ((cpu, ON_CPU), (gpu, ON_GPU)):
        if layers:
            rules.append({"match": {"name": rf"^model\.layers\.{layers_regex(layers)}\.{where}$"},
                          "replace": {"class": EXPERTS_CLASS, "kwargs": dict(kwargs)}, "recursive": False})
    embed = next(p for p in plan.placement if p["kind"] == "embed")["weights"] == "gpu"
    dev = "cuda" if embed else "cpu"
    rules += [
        {"match": {"name": r"^lm_head$", "class": "torch.nn.Linear"},
         "replace": {"class": LINEAR_CLASS, "kwargs": dict(LINEAR)}},
        {"match": {"name": r"^model\.layers\..*$", "class": "torch.nn.Linear"},
         "replace": {"class": LINEAR_CLASS, "kwargs": dict(LINEAR)}},
        {"match": {"name": r"^model\.embed_tokens"},
         "replace": {"class": "default", "kwargs": {"generate_device": dev, "prefill_device": dev}}},
        {"match": {"name": r"^model\.layers\..*\."},
         "replace": {"class": "default", "kwargs": {"generate_device": "cuda", "prefill_device": "cuda"}}},
    ]
    split = [p["layer"] for p in moe if p["weights"] == "gpu" and p.get("experts_on_gpu") not in (None, 0, spec.n_experts)]
    notes = [f"split experts in {len(split)} layers: kTransformers places a layer's experts together; "
             f"they run on the CPU"] if split else []
    text = yaml.safe_dump(rules, sort_keys=False, width=1000)
    return Export("ktransformers", text, f"from-ktransformers:{text}", tuple(notes),
                  usage="python -m ktransformers.local_chat --model_path MODEL --gguf_path GGUF_DIR "
                        "--optimize_config_path RULES.yaml")
