"""``--strategy from-vllm:ARGS``: vLLM's weight-offloading options -> the placement they mean.

Checked against vLLM's source, ``vllm/config/offload.py`` (vllm-project/vllm at commit
2debd782f06a5731359728ed77cd6a7299ef4e49: ``OffloadConfig`` with ``cpu_offload_gb``,
``offload_group_size`` (default 0, off), ``offload_num_in_group`` (default 1, at most the group
size) and ``offload_prefetch_step`` (default 1, at least 1 once the group size is set); and its
later layout in the same file, where ``offload_backend`` (``auto`` | ``uva`` | ``prefetch``;
``auto`` takes prefetch when the group size is set, else UVA when ``cpu_offload_gb`` is) selects
between a ``UVAOffloadConfig`` and a ``PrefetchOffloadConfig``, each with a parameter-segment
filter, ``--cpu-offload-params`` and ``--offload-params``). The offloaders wrap only the
decoder layers (the embedding and the head stay on the GPU, as do KV caches):
- UVA (``--cpu-offload-gb G``): parameters of the layers in order, from the first, move to
  pinned host memory until G GiB are offloaded (a parameter is offloaded while the total is
  still below G, so the last may overshoot); the GPU reads them over PCIe inside its kernels, in
  both phases: exec ``stream`` at depth 1, no prefetch. Priced per block here: a block is
  offloaded when the bytes offloaded before it are below G.
- prefetch (``--offload-group-size N --offload-num-in-group K --offload-prefetch-step S``):
  in each group of N consecutive layers the last K are offloaded (layer ``i`` when
  ``i mod N >= N - K``; vLLM's example: N 8, K 2 offloads layers 6, 7, 14, 15, ...) and copied
  asynchronously S layers ahead: streamed at depth ``S + 1``.
The parameter filters offload only some tensors of a layer; hetplan places whole blocks, so it
refuses them rather than read a different placement. ``--kv-offloading-size`` keeps evicted
prefix-cache blocks in host memory for reuse; the KV of running sequences stays on the GPU, so it
does not change a plan and is only read.
"""

from __future__ import annotations

import shlex

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem

VALUED = ("--cpu-offload-gb", "--offload-group-size", "--offload-num-in-group", "--offload-prefetch-step",
          "--offload-backend", "--kv-offloading-size", "--kv-offloading-backend", "--max-model-len",
          "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization")
FILTERS = ("--offload-params", "--cpu-offload-params")
"""vLLM's parameter-segment filters (offload only matching tensors of a layer): refused."""
BACKENDS = ("auto", "uva", "prefetch")
GIB = 2 ** 30


def parse(text: str) -> dict:
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise HetplanError(f"--strategy from-vllm: cannot split the arguments ({e})") from None
    out, i = {}, 0
    while i < len(words):
        w = words[i]
        flag, eq, inline = w.partition("=")
        flag = flag.replace("_", "-")
        if flag in FILTERS:
            raise HetplanError(f"--strategy from-vllm: {flag} offloads only the matching parameters of each "
                               f"layer; hetplan places whole attention and MLP blocks and cannot read that "
                               f"placement; drop it (and its values)")
        if flag not in VALUED:
            raise HetplanError(f"--strategy from-vllm: option {w!r} is not one hetplan reads (it reads "
                               f"{', '.join(VALUED)}); drop it")
        if eq:
            out[flag], i = inline, i + 1
        elif i + 1 < len(words):
            out[flag], i = words[i + 1], i + 2
        else:
            raise HetplanError(f"--strategy from-vllm: {flag} needs a value")
    return out


def _number(opts: dict, flag: str, default, kind=int):
    v = opts.get(flag)
    if v is None:
        return default
    try:
        x = kind(v)
    except ValueError:
        x = -1
    if not 0 <= x < float("inf"):  # also nan
        raise HetplanError(f"--strategy from-vllm: {flag} {v!r}: expected a non-negative number (a finite one)")
    return x


def decide(problem: Problem, text: str) -> Decision:
    from hetplan.solvers import baselines

    opts = parse(text)
    if not problem.has_gpu:
        raise HetplanError("--strategy from-vllm: vLLM's weight offloading needs a GPU; this node has none")
    budget_bytes = _number(opts, "--cpu-offload-gb", 0.0, float) * GIB
    group, k = _number(opts, "--offload-group-size", 0), _number(opts, "--offload-num-in-group", 1)
    step = _number(opts, "--offload-prefetch-step", 1)
    backend = opts.get("--offload-backend", "auto")
    if backend not in BACKENDS:
        raise HetplanError(f"--strategy from-vllm: --offload-backend {backend!r}: vLLM's backends are "
                           f"{', '.join(BACKENDS)}")
    prefetch = backend == "prefetch" or (backend == "auto" and group > 0)
    if prefetch and not (0 < k <= group):
        raise HetplanError(f"--strategy from-vllm: --offload-num-in-group {k} must be between 1 and "
                           f"--offload-group-size ({group})")
    if prefetch and step < 1:
        raise HetplanError(f"--strategy from-vllm: --offload-prefetch-step {step}: vLLM requires at least 1 "
                           f"with the prefetch offloader (it copies each offloaded layer that many layers ahead)")
    offloaded, done = set(), 0.0
    for b in problem.blocks:
        if b.layer is None:
            continue
        if prefetch:
            if b.layer % group >= group - k:
                offloaded.add(b.name)
        elif done < budget_bytes:
            offloaded.add(b.name)
            done += b.weight_bytes
    if not offloaded:
        return baselines.all_gpu(problem)
    weights = {b.name: ("stream" if b.streamable else "cpu") if b.name in offloaded else "gpu" for b in problem.blocks}
    exec_ = {ph: dict(weights) for ph in PHASES}
    kv = {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}
    return Decision(weights=weights, exec=exec_, kv=kv, depth=step + 1 if prefetch else 1)
