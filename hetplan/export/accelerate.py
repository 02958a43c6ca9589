"""A plan as an Accelerate ``device_map`` (transformers module name -> ``0`` | ``"cpu"``) and
``max_memory``, as JSON, with the Python that loads a model with them.

What Accelerate can say: per module, resident on the GPU or in host memory; an offloaded module
is copied to the GPU before every use, synchronously, in both phases. It cannot compute on the
CPU beside a GPU, keep KV caches in host memory, prefetch, or split a fused expert tensor (in
transformers 5 a layer's routed experts are one module, ``mlp.experts``). Tied embeddings share
one device.
"""

from __future__ import annotations

import json

from hetplan.export.names import hf_extra_modules, hf_modules
from hetplan.export.result import Export
from hetplan.plan import Plan

SNIPPET = """\
import json
from transformers import AutoModelForCausalLM

cfg = json.load(open(CONFIG_FILE))
max_memory = {{int(k) if k.isdigit() else k: v for k, v in cfg["max_memory"].items()}}
model = AutoModelForCausalLM.from_pretrained({model}, device_map=cfg["device_map"], max_memory=max_memory)"""
"""``CONFIG_FILE`` stands for the exported file; the command line names it."""


def device_map(plan: Plan) -> tuple:
    """(module -> 0 | "cpu", notes)."""
    spec, gpu = plan.model, bool(plan.hardware.gpus)
    on = {p["block"]: p for p in plan.placement}
    notes, out = [], {}
    for block, mods in hf_modules(spec).items():
        p = on[block]
        resident = gpu and p["weights"] == "gpu"
        hot = p.get("experts_on_gpu")
        cold = p["kind"] == "moe" and resident and hot is not None and hot < spec.n_experts
        for m in mods:
            is_experts = m.endswith(".mlp.experts")
            out[m] = 0 if resident and not (cold and is_experts) else "cpu"
    split = [p["layer"] for p in plan.placement if p["kind"] == "moe" and p["weights"] == "gpu"
             and p.get("experts_on_gpu") not in (None, 0, spec.n_experts)]
    if split:
        notes.append(f"split experts in {len(split)} layers: a transformers layer's experts are one module, "
                     f"offloaded whole")
    if spec.tie_embeddings and gpu and (on["embed"]["weights"] == "gpu") != (on["head"]["weights"] == "gpu"):
        notes.append("tied embeddings: the embedding and lm_head share one tensor, so both go where lm_head goes")
        for m in hf_modules(spec)["embed"][:1]:
            out[m] = out["lm_head"]
    for m in hf_extra_modules(spec):
        out[m] = 0 if gpu else "cpu"
    return out, notes


def emit(plan: Plan) -> Export:
    dmap, notes = device_map(plan)
    mem = plan.memory
    max_memory = ({"0": int(mem["gpu_budget_bytes"])} if plan.hardware.gpus else {}) | {"cpu": int(mem["cpu_budget_bytes"])}
    text = json.dumps({"device_map": dmap, "max_memory": max_memory}, indent=1) + "\n"
    source = str(plan.inputs.get("model_source") or plan.model.name)
    source = source[:-len("/config.json")] if source.endswith("/config.json") else source
    if source.endswith(".gguf"):  # transformers dequantises a GGUF file it is pointed at
        directory, _, name = source.rpartition("/")
        model = f"{directory or '.'!r}, gguf_file={name!r}"
    else:
        model = repr(source)
    usage = "\n" + SNIPPET.format(model=model)
    compact = json.dumps({"device_map": dmap}, separators=(",", ":"))
    return Export("accelerate", text, f"from-accelerate:{compact}", tuple(notes), usage=usage)
