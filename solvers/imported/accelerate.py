"""``--strategy from-accelerate:FILE|JSON``: an Accelerate ``device_map`` (module name -> ``0`` |
``"cpu"``; optionally beside ``max_memory`` in ``{"device_map": ..., "max_memory": ...}``) -> the
placement it means, executed as the ``greedy`` baseline executes Accelerate's placements.

Follows Accelerate 1.x (``dispatch_model``): a module mapped to ``"cpu"`` while the model also
uses a GPU keeps its weights in host memory, and its pre-forward hook copies them to the GPU
synchronously before each use, in both phases (exec ``stream``, depth 1); KV caches live on the
GPU. A key names its module and everything inside it; the most specific key wins. A block is
on the GPU when all its modules are; a MoE block whose ``mlp.experts`` alone is on ``"cpu"``
keeps the rest resident and streams its routed experts. ``max_memory`` is not read: with an
explicit map, ``from_pretrained`` places by the map alone.
"""

from __future__ import annotations

import json

from hetplan.errors import HetplanError
from hetplan.export.names import hf_extra_modules, hf_modules
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem

GPU_VALUES = (0, "0", "cuda", "cuda:0")


def parse(text: str) -> dict:
    """module name -> ``gpu`` | ``cpu`` from the JSON ``text``."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise HetplanError(f"--strategy from-accelerate: not a JSON device map (line {e.lineno}, column "
                           f"{e.colno}: {e.msg}); give a file or a JSON object") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise HetplanError(f"--strategy from-accelerate: not a JSON device map ({str(e).split(';')[0]})") from None
    if isinstance(doc, dict) and "device_map" in doc:
        doc = doc["device_map"]
    if not isinstance(doc, dict) or not doc:
        raise HetplanError("--strategy from-accelerate: expected a JSON object mapping module names to 0 or \"cpu\"")
    out = {}
    for key, dev in doc.items():
        if dev in GPU_VALUES:
            out[key] = "gpu"
        elif dev == "cpu":
            out[key] = "cpu"
        else:
            raise HetplanError(f"--strategy from-accelerate: device_map[{key!r}] = {dev!r}: hetplan reads 0 (the GPU) "
                               f"or \"cpu\" (use \"cpu\" instead of \"disk\")")
    return out


def device_of(module: str, device_map: dict) -> set:
    """The devices ``module``'s parameters get: from its most specific ancestor-or-self key, and
    from any key naming a part of it."""
    inside = {d for k, d in device_map.items() if k.startswith(module + ".")}
    above = [k for k in device_map if k == "" or module == k or module.startswith(k + ".")]
    if above:
        inside.add(device_map[max(above, key=len)])
    return inside


def decide(problem: Problem, text: str) -> Decision:
    from hetplan.solvers import baselines

    device_map = parse(text)
    spec = problem.model
    modules = hf_modules(spec)
    known = [m for ms in modules.values() for m in ms] + hf_extra_modules(spec)
    for key in device_map:
        if key and not any(m == key or m.startswith(key + ".") or key.startswith(m + ".") for m in known):
            raise HetplanError(f"--strategy from-accelerate: device_map key {key!r} names no module of {spec.name} "
                               f"({spec.arch}, {spec.n_layers} layers)")
    if not problem.has_gpu or all(d == "cpu" for d in device_map.values()):
        return baselines.all_cpu(problem)
    weights, exec_, experts = {}, {ph: {} for ph in PHASES}, {}
    for b in problem.blocks:
        devs = [device_of(m, device_map) for m in modules[b.name]]
        for m, d in zip(modules[b.name], devs):
            if not d:
                raise HetplanError(f"--strategy from-accelerate: the device map places no key on module {m!r}; "
                                   f"map it (or a module above it) to 0 or \"cpu\"")
        on_gpu = all(d == {"gpu"} for d in devs)
        experts_only = b.kind == "moe" and all(d == {"gpu"} for d in devs[:-1]) and devs[-1] == {"cpu"}
        weights[b.name] = "gpu" if on_gpu or experts_only else "stream" if b.streamable else "cpu"
        if experts_only:
            experts[b.name] = 0
        for ph in PHASES:
            exec_[ph][b.name] = "gpu" if on_gpu else weights[b.name] if not experts_only else "stream"
    kv = {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}
    return Decision(weights=weights, exec=exec_, kv=kv, depth=1, experts=experts)
