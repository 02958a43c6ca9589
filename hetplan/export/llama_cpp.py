"""A plan as llama-server / llama-cli arguments: ``-ngl``, ``-ot PATTERN=CPU`` per tensor group
(or ``--n-cpu-moe N`` / ``--cpu-moe`` when they say the same), ``-nkvo``, ``-c``, ``-b``/``-ub``,
``-t``.

What llama.cpp can say: per tensor, host memory or the GPU; per layer, KV with the layer (the
last ``-ngl`` layers on the GPU) or every KV in host memory (``-nkvo``). What it decides itself:
a host-resident tensor is computed on the CPU in decode and copied to the GPU synchronously for
a prefill micro-batch of 32+ tokens (op offload); the token embeddings stay in host memory; a
layer's routed experts are one tensor per projection, so they are all in one place.
Regexes are anchored and list layer ranges compactly; they are checked here against the model's
tensor names (the GGUF file's own when the plan was compiled from one).
"""

from __future__ import annotations

import re
import shlex

from hetplan.export.names import gguf_arch, gguf_block, gguf_tensor_names, is_expert_tensor
from hetplan.export.regex import layers_regex, runs
from hetplan.export.result import CannotExpress, Export
from hetplan.plan import Plan

COMPONENTS = {"layer": "", "attn": "attn_", "ffn": "(ffn_|exp_probs_b\\.)", "exps": "ffn_(gate|up|down)_exps\\.weight$"}
"""Tensor groups of one layer, as the regex text after ``^blk\\.N\\.``."""


def emit(plan: Plan) -> Export:
    spec, source = plan.model, plan.inputs.get("model_source")
    if gguf_arch(spec) is None and not str(source or "").endswith(".gguf"):
        raise CannotExpress(f"llama.cpp has no architecture for {spec.arch} models ({spec.name}): it can express "
                            f"no part of this plan; nothing was written")
    names = gguf_tensor_names(spec, source)
    by_block = {p["block"]: p for p in plan.placement}
    notes = []
    want = {}
    for name in names:
        p = by_block.get(gguf_block(name, spec))
        if p is None:
            continue
        gpu = p["weights"] == "gpu"
        if gpu and p["kind"] == "moe" and is_expert_tensor(name):
            gpu = (p.get("experts_on_gpu") if p.get("experts_on_gpu") is not None else spec.n_experts) >= spec.n_experts
        want[name] = gpu and name != "token_embd.weight"
    if by_block.get("embed", {}).get("weights") == "gpu" and plan.hardware.gpus:
        notes.append("token embeddings: llama.cpp keeps them in host memory (the plan has them on the GPU)")
    split = [p["layer"] for p in plan.placement if p["kind"] == "moe" and p["weights"] == "gpu"
             and 0 < (p.get("experts_on_gpu") if p.get("experts_on_gpu") is not None else spec.n_experts) < spec.n_experts]
    if split:
        notes.append(f"split experts (some of a layer's experts on the GPU) in layers {_spans(split)}: a llama.cpp "
                     f"layer's experts are one tensor per projection, so all of them stay in host memory")
    ngl, nkvo, kv_note = _layer_slots(plan)
    if kv_note:
        notes.append(kv_note)
    if not plan.hardware.gpus:
        return _export(plan, ["-ngl", "0"], notes)
    first = spec.n_layers + 1 - ngl
    default = {n: (False if n == "token_embd.weight" else int(n.split(".")[1]) >= first if n.startswith("blk.")
                   else spec.n_layers >= first) for n in want}
    words = ["-ngl", str(ngl)]
    moe_flag = _moe_flag(plan, {n: g for n, g in want.items() if g or default[n]})
    for target, gpu in (("CPU", False), ("CUDA0", True)):
        moved = {n for n in want if want[n] == gpu and default[n] != gpu}
        for pattern in _patterns(moved, names, skip_exps=bool(moe_flag) and not gpu):
            words += ["-ot", f"{pattern}={target}"]
    words += moe_flag + (["-nkvo"] if nkvo else []) + (["--no-op-offload"] if _no_op_offload(plan) else [])
    return _export(plan, words, notes)


def _no_op_offload(plan: Plan) -> bool:
    """``--no-op-offload`` when the plan keeps weights in host memory (whole blocks, or a MoE
    layer's cold experts) and streams none of them in prefill: llama.cpp would otherwise copy
    them to the GPU for a prompt micro-batch of 32+ tokens."""
    n = plan.model.n_experts
    host = [p for p in plan.placement if p["kind"] != "embed" and (p["weights"] != "gpu" or (
        p["kind"] == "moe" and p.get("experts_on_gpu") is not None and p["experts_on_gpu"] < n))]
    return bool(host) and not any(p["exec"]["prefill"] == "stream" for p in plan.placement)


def _export(plan: Plan, words: list, notes: list) -> Export:
    wl, hw = plan.workload, plan.hardware
    words = words + ["-c", str(wl.batch * wl.context_len)]
    if wl.batch > 1:
        words += ["-np", str(wl.batch)]
    ub = wl.batch * wl.chunk_len
    words += ["-b", str(ub), "-ub", str(ub)]
    if hw.cpu.cores:
        words += ["-t", str(hw.cpu.cores)]
    text = shlex.join(words)
    return Export("llama.cpp", text + "\n", f"from-llama.cpp:{text}", tuple(notes),
                  usage=f"llama-server -m MODEL.gguf {text}")


def _layer_slots(plan: Plan) -> tuple:
    """(-ngl, -nkvo, note): KV on the GPU for the last -ngl layers, or none with -nkvo."""
    n = plan.model.n_layers
    cpu_kv = sorted(p["layer"] for p in plan.placement if p["kind"] == "attn" and p["kv"] == "cpu")
    if not cpu_kv:
        return n + 1, False, ""
    if len(cpu_kv) == n:
        resident = any(p["weights"] == "gpu" for p in plan.placement if p["layer"] is not None)
        return (n + 1, True, "") if resident else (0, False, "")
    k = cpu_kv[-1] + 1
    note = "" if cpu_kv == list(range(k)) else (
        f"KV caches: llama.cpp keeps KV in host memory for the first layers (outside -ngl) or for all (-nkvo); "
        f"the plan's CPU caches are in layers {_spans(cpu_kv)}, so layers 0-{k - 1} keep theirs there")
    return n + 1 - k, False, note


def _moe_flag(plan: Plan, want: dict) -> list:
    """``--cpu-moe`` / ``--n-cpu-moe N`` when the host-resident expert tensors are exactly those
    of the MoE layers below N (and the GPU keeps every other layer's)."""
    spec = plan.model
    cpu = {int(n.split(".")[1]) for n, gpu in want.items() if is_expert_tensor(n) and not gpu}
    moe_layers = {l for l in range(spec.n_layers) if spec.is_moe_layer(l)}
    if not cpu:
        return []
    top = max(cpu) + 1
    if cpu != {l for l in moe_layers if l < top}:
        return []
    return ["--cpu-moe"] if cpu == moe_layers else ["--n-cpu-moe", str(top)]


def _patterns(moved: set, names: list, skip_exps: bool = False) -> list:
    """Anchored patterns matching exactly the tensors ``moved`` among ``names``: whole layers,
    a layer's attention, its FFN, or its routed experts, each over a compact layer set."""
    per_layer: dict = {}
    top = sorted(n for n in moved if not n.startswith("blk."))
    for n in moved:
        if n.startswith("blk."):
            per_layer.setdefault(int(n.split(".")[1]), set()).add(n)
    layer_names: dict = {}
    for n in names:
        if n.startswith("blk."):
            layer_names.setdefault(int(n.split(".")[1]), set()).add(n)
    groups: dict = {c: [] for c in COMPONENTS}
    for l, got in per_layer.items():
        all_ = layer_names[l]
        attn = {n for n in all_ if n.split(".", 2)[2].startswith("attn_")}
        ffn = all_ - attn
        has_attn, has_ffn = attn <= got, ffn <= got
        if has_attn and has_ffn:
            groups["layer"].append(l)
            continue
        if has_attn:
            groups["attn"].append(l)
        if has_ffn:
            groups["ffn"].append(l)
        elif got & ffn:
            groups["exps"].append(l)
    out = [f"^blk\\.{layers_regex(ls)}\\.{COMPONENTS[c]}" for c, ls in groups.items()
           if ls and not (c == "exps" and skip_exps)]
    if top:
        out.append("^(" + "|".join(re.escape(n) for n in top) + ")$" if len(top) > 1 else f"^{re.escape(top[0])}$")
    matched = {n for n in names if any(re.search(p, n) for p in out)}
    expected = moved - ({n for n in moved if is_expert_tensor(n) and _exps_only(n, groups)} if skip_exps else set())
    if matched != expected:  # a bug here, not the user's input
        raise AssertionError(f"override patterns match {sorted(matched ^ expected)[:3]} wrongly")
    return out


def _exps_only(name: str, groups: dict) -> bool:
    return int(name.split(".")[1]) in groups["exps"]


def _spans(layers) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs(layers))
