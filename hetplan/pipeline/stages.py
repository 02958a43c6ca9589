"""One pipeline stage as a single-GPU problem: a slice of the model's layers on one GPU, the
embedding only in the first stage and the head only in the last, and the hidden state that
crosses to the next stage. Knows nothing about how stage boundaries are chosen.
"""

from __future__ import annotations

import dataclasses

from hetplan import cost
from hetplan.errors import HetplanError
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.problem import Problem, build_problem
from hetplan.workload import Workload

ENDS = ("embed", "head")


def slice_model(spec: ModelSpec, first: int, end: int) -> ModelSpec:
    """The model's layers ``[first, end)`` as a model of their own (a dense prefix of an MoE
    model, e.g. DeepSeek's first layers, kept where it falls)."""
    if spec.extra.get("source") == "onnx" or spec.block_bytes:
        raise HetplanError(f"{spec.name}: several GPUs are planned for preset and config.json models; "
                           f"a model whose blocks are priced from its file (GGUF, ONNX) is planned on one "
                           f"GPU: pass a node with one GPU")
    dense = min(end - first, max(0, spec.first_dense_layers - first))
    return dataclasses.replace(spec, n_layers=end - first, first_dense_layers=dense)


def without_ends(problem: Problem, keep: set) -> Problem:
    """``problem`` with the embedding and/or head not in ``keep`` made free: no bytes, no time.
    They belong to the first and the last stage only; a free block is placed anywhere at no cost."""
    drop = set(ENDS) - keep
    blocks = tuple(dataclasses.replace(b, weight_bytes=0.0) if b.name in drop else b for b in problem.blocks)
    stages = {ph: tuple(dataclasses.replace(sc, gpu_s=0.0, cpu_s=0.0, up_s=0.0, down_s=0.0)
                        if sc.stage.block in drop else sc for sc in chain)
              for ph, chain in problem.stages.items()}
    load_s = {b: 0.0 if b in drop else s for b, s in problem.load_s.items()}
    return dataclasses.replace(problem, graph=dataclasses.replace(problem.graph, blocks=blocks),
                               stages=stages, load_s=load_s)


def with_kv_copies(problem: Problem, copies: int) -> Problem:
    """``problem`` holding ``copies`` KV caches per attention block, one per micro-batch in flight:
    each block's ``kv_bytes`` (``batch x context x kv_bytes_per_token``) times ``copies``. Only
    memory grows: a pass reads and writes one micro-batch's cache, so no time changes."""
    if copies == 1:
        return problem
    blocks = tuple(dataclasses.replace(b, kv_bytes=b.kv_bytes * copies) if b.kv_bytes else b for b in problem.blocks)
    return dataclasses.replace(problem, graph=dataclasses.replace(problem.graph, blocks=blocks))


def stage_problem(spec: ModelSpec, hw: HardwareSpec, wl: Workload, k: int, first: int, end: int,
                  kv_copies: int = 1) -> Problem:
    """Layers ``[first, end)`` on GPU ``k`` alone (with the embedding when ``first == 0``, the
    head when ``end == n_layers``), with ``kv_copies`` KV caches (``with_kv_copies``)."""
    return device_problem(spec, hw.single_gpu(k), wl, first, end, kv_copies)


def device_problem(spec: ModelSpec, hw: HardwareSpec, wl: Workload, first: int, end: int,
                   kv_copies: int = 1) -> Problem:
    """Layers ``[first, end)`` on the single-device machine ``hw`` (one GPU, or none), holding
    ``kv_copies`` KV caches: one per micro-batch in flight (``with_kv_copies``)."""
    keep = {"embed"} if first == 0 else set()
    if end == spec.n_layers:
        keep.add("head")
    return with_kv_copies(without_ends(build_problem(slice_model(spec, first, end), hw, wl), keep), kv_copies)


def hidden_bytes(spec: ModelSpec, wl: Workload, phase: str) -> float:
    """The hidden state one stage hands the next: tokens x hidden x bytes per activation."""
    tokens = wl.batch * (wl.prompt_len if phase == "prefill" else 1)
    return tokens * spec.hidden * cost.activation_bytes_per_elem(spec)
