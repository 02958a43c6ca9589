"""Baseline placements: what a user gets from today's tools, under hetplan's cost model.

Each maps a Problem to a Decision the way the tool it names places a model, as far as the
plan's task model can say it; each docstring names the version of the tool it follows and what
it leaves out (``FOLLOWS`` holds the versions, printed by ``--compare``). They double as test
oracles: the ILP must never be worse than any of them. On a node without a GPU every baseline
is the all-CPU plan.
"""

from __future__ import annotations

import dataclasses

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem

LLAMA_CPP = "llama.cpp master of late 2026 (common/fit.cpp at 08033df, src/llama.cpp at 01649e6)"
ACCELERATE = "Accelerate 1.x infer_auto_device_map (utils/modeling.py at 00cfd46)"
KTRANSFORMERS = "kTransformers 0.2 (DeepSeek-V3/R1 tutorial, optimize rules DeepSeek-V3-Chat.yaml)"
FLEXGEN = "FlexLLMGen (FlexGen) flexllmgen/flex_opt.py at 004ffef"
FOLLOWS = {"all-gpu": "-", "greedy": ACCELERATE, "ngl": LLAMA_CPP, "ngl-nkvo": LLAMA_CPP,
           "stream": "FlexGen-style policy (not a particular release)", "flexgen": FLEXGEN,
           "cpu-moe": LLAMA_CPP, "n-cpu-moe": LLAMA_CPP, "ktransformers": KTRANSFORMERS}
"""strategy -> the tool and version its baseline follows."""
FAITHFUL = ("all-gpu", "greedy", "ngl", "ngl-nkvo", "flexgen", "cpu-moe", "n-cpu-moe", "ktransformers")
"""Baselines that reproduce a tool's placement and execution (``stream`` is a policy, not a
particular release of FlexGen, whose own policy search picks other fractions)."""

OP_OFFLOAD_MIN_TOKENS = 32
"""llama.cpp's CUDA backend computes an op whose weights are in host memory on the GPU (copying
them up) when the op's batch, the tokens of the micro-batch, is at least this many
(``ggml_backend_cuda_device_offload_op``; ``GGML_OP_OFFLOAD_MIN_BATCH`` overrides it). Token
embedding lookups (``GET_ROWS``) count a batch of 0 and are never moved."""
FIT_MARGIN_BYTES = float(1 << 30)
"""Free device memory ``--fit`` leaves (``--fit-target``, default 1024 MiB)."""


def _decision(problem: Problem, weights: dict, kv: dict, depth: int) -> Decision:
    exec_ = {ph: {n: w for n, w in weights.items()} for ph in PHASES}
    return Decision(weights=weights, exec=exec_, kv=kv, depth=depth)


def all_cpu(problem: Problem) -> Decision:
    return _decision(problem, {b.name: "cpu" for b in problem.blocks},
                     {b.name: "cpu" for b in problem.blocks if b.kind == "attn"}, depth=1)


def all_gpu(problem: Problem) -> Decision:
    """Everything resident on the GPU (what works when the model fits)."""
    if not problem.has_gpu:
        return all_cpu(problem)
    return _decision(problem, {b.name: "gpu" for b in problem.blocks},
                     {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}, depth=1)


# -- Accelerate ---------------------------------------------------------------------------------

def _accelerate_units(problem: Problem) -> list:
    """Accelerate's unsplittable modules in module order, as lists of blocks: the embedding
    (with the head when the embeddings are tied: tied parameters go together), one decoder
    layer (attention + MLP, a ``no_split_module``) per layer, the head."""
    by_layer: dict = {}
    for b in problem.blocks:
        if b.layer is not None:
            by_layer.setdefault(b.layer, []).append(b)
    embed = next(b for b in problem.blocks if b.kind == "embed")
    head = next(b for b in problem.blocks if b.kind == "head")
    tied = problem.model.tie_embeddings
    return [[embed, head] if tied else [embed]] + [by_layer[l] for l in sorted(by_layer)] + ([] if tied else [[head]])


def greedy(problem: Problem) -> Decision:
    """Accelerate ``device_map="auto"`` (``infer_auto_device_map``, Accelerate 1.x), then its
    offload hooks.

    Placement: modules in order onto the GPU while ``used + size <= max_memory - reserve``,
    where ``max_memory`` is the GPU budget and ``reserve`` the largest module not yet placed
    (Accelerate keeps room to bring the largest offloaded layer back; it computes the maximum
    once and recomputes it over the remaining modules only when every module of that size has
    been placed). The first module that does not fit sends it and all later ones to the CPU;
    nothing goes back. Sizes are weights only: Accelerate counts no KV cache and no activation
    workspace, so a placement can overrun the GPU (the plan's memory check then says by how
    much, as the real run would fail).

    Execution: every offloaded module is copied to the GPU synchronously by its pre-forward hook
    right before use, in both phases, no prefetch (exec ``stream`` at depth 1). KV caches live
    on the GPU, where every layer executes.

    Leaves out: modules are hetplan's blocks (a layer's norms are in its blocks, the final norm
    in the head); an offloaded embedding is gathered on the CPU (hetplan never streams the
    table); offloaded weights are priced as pinned copies (Accelerate's are pageable, slower)."""
    if not problem.has_gpu:
        return all_cpu(problem)
    units = _accelerate_units(problem)
    sizes = [sum(b.weight_bytes for b in u) for u in units]
    reserve, largest = _largest(sizes, range(len(units)))
    weights, used, offloading = {}, 0.0, False
    for i, unit in enumerate(units):
        largest.discard(i)
        if not largest:
            reserve, largest = _largest(sizes, range(i + 1, len(units)))
        offloading = offloading or used + sizes[i] > problem.gpu_budget_bytes - reserve
        used += 0.0 if offloading else sizes[i]
        for b in unit:
            weights[b.name] = "gpu" if not offloading else ("stream" if b.streamable else "cpu")
    return _decision(problem, weights, {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}, depth=1)


def _largest(sizes: list, indices) -> tuple:
    """(largest size among ``indices``, the set of indices of that size); (0, empty) if none."""
    indices = list(indices)
    if not indices:
        return 0.0, set()
    top = max(sizes[i] for i in indices)
    return top, {i for i in indices if sizes[i] == top}


# -- llama.cpp ----------------------------------------------------------------------------------

def op_offload(problem: Problem) -> bool:
    """Whether llama.cpp computes host-resident weights on the GPU in prefill: the prompt's
    micro-batch (``min(batch * prompt_len, n_ubatch = 512)`` tokens) has at least
    ``OP_OFFLOAD_MIN_TOKENS`` tokens."""
    wl = problem.workload
    return problem.has_gpu and wl.batch * wl.prompt_len >= OP_OFFLOAD_MIN_TOKENS


def head_offload(problem: Problem) -> bool:
    """Whether llama.cpp copies a host-resident output layer up for prefill. The graph keeps only
    the positions that want logits before the output layer (``ggml_get_rows`` with
    ``inp_out_ids``: the last token of each sequence), so the output matmul's batch is the number
    of sequences, not the prompt's tokens, and op offload applies to it only from
    ``OP_OFFLOAD_MIN_TOKENS`` sequences on."""
    return problem.has_gpu and problem.workload.batch >= OP_OFFLOAD_MIN_TOKENS


def _llama_cpp(problem: Problem, on_gpu: set, kv: dict, experts: dict | None = None,
               offload: bool | None = None) -> Decision:
    """llama.cpp's execution of a placement: blocks in ``on_gpu`` resident in HBM, the others in
    DRAM. Decode computes each block where its weights are. Prefill with op offload computes a
    host-resident block on the GPU with its weights copied up (weights ``stream``, prefill exec
    ``stream``), and an MoE block's host-resident experts likewise (their expert tensors are
    copied up); the embedding lookup stays on the CPU, and so does a host-resident output layer
    for fewer than 32 sequences (``head_offload``). The scheduler copies a split's inputs
    right before computing it (``ggml_backend_sched_compute_splits``); a host-to-CUDA weight copy
    has no async path, so it waits for the GPU to finish and copies synchronously: nothing is
    prefetched, staging depth 1, a copy never overlaps the compute before it.

    Leaves out: llama.cpp copies only the experts the micro-batch routes to (with uniform
    routing ``n (1 - (1 - k/n)^T)`` of ``n`` for ``T`` tokens choosing ``k``: all of them, to
    0.1%, for every preset at 512 tokens; fewer for short prompts), here all of them.
    ``offload=False`` turns op offload off (llama.cpp ``--no-op-offload``; kTransformers)."""
    offload = op_offload(problem) if offload is None else offload
    experts = experts or {}
    weights, exec_ = {}, {ph: {} for ph in PHASES}
    for b in problem.blocks:
        if b.name in on_gpu:
            weights[b.name] = "gpu"
            cold = b.name in experts and experts[b.name] < problem.model.n_experts
            exec_["prefill"][b.name] = "stream" if cold and offload else "gpu"
            exec_["decode"][b.name] = "gpu"
        else:
            copied = offload and b.streamable and (b.kind != "head" or head_offload(problem))
            weights[b.name] = "stream" if copied else "cpu"
            exec_["prefill"][b.name] = "stream" if copied else "cpu"
            exec_["decode"][b.name] = "cpu"
    return Decision(weights=weights, exec=exec_, kv=kv, depth=1, experts=experts)


def ngl(problem: Problem, n: int | None = None, nkvo: bool = False) -> Decision:
    """llama.cpp ``-ngl N`` (``llama_model::load_tensors``): of the ``n_layers + 1`` layer slots
    (the repeating layers, then the output layer: final norm and lm_head) the last N are on the
    GPU, i.e. layer ``il`` is on the GPU when ``il >= n_layers + 1 - N``: ``-ngl 1`` is the
    output layer alone, ``-ngl n_layers + 1`` everything. The token embeddings always stay in
    host memory. Each layer's KV cache lives with the layer; ``nkvo`` (``-nkvo``) keeps every
    KV cache in DRAM, so decode attention runs on the CPU. Executed as ``_llama_cpp`` says (op
    offload of the CPU layers in prefill of 32+ tokens).

    ``n=None`` is ``--fit`` (``common_fit_params`` for one GPU, dense layers): all slots when
    everything fits with ``FIT_MARGIN_BYTES`` of the budget left free, else the most slots that
    leave that margin (0 when none does). Memory counts weights, KV caches, staging and
    workspace on the GPU, as ``--fit`` measures model, context and compute buffers.

    Leaves out: ``--fit``'s context shrinking (the workload fixes the context) and its partial
    last layer (some of one layer's FFN tensors kept in DRAM); on MoE models ``--fit`` moves
    expert tensors instead (see ``n_cpu_moe``); with ``nkvo``, prefill attention of a GPU layer
    runs on the GPU with its K/V copied down (llama.cpp runs it on the CPU); a prompt longer
    than one 512-token micro-batch copies offloaded weights once per micro-batch in llama.cpp,
    once here."""
    spec = problem.model
    if not problem.has_gpu:
        return all_cpu(problem)
    if n is None:
        target = problem.gpu_budget_bytes - FIT_MARGIN_BYTES
        for k in range(spec.n_layers + 1, -1, -1):
            dec = ngl(problem, k, nkvo)
            if _gpu_bytes(problem, dec) <= target:
                return dec
        return ngl(problem, 0, nkvo)
    if n < 0:
        raise HetplanError(f"--strategy ngl:{n}: N must be >= 0")
    first_gpu = spec.n_layers + 1 - min(n, spec.n_layers + 1)
    on_gpu = {b.name for b in problem.blocks
              if (b.layer is not None and b.layer >= first_gpu) or (b.kind == "head" and n >= 1)}
    kv = {b.name: "gpu" if b.name in on_gpu and not nkvo else "cpu" for b in problem.blocks if b.kind == "attn"}
    return _llama_cpp(problem, on_gpu, kv)


def ngl_nkvo(problem: Problem, n: int | None = None) -> Decision:
    """llama.cpp ``-ngl N -nkvo``: ``ngl`` with every KV cache (and decode attention) on the CPU."""
    return ngl(problem, n, nkvo=True)


def cpu_moe(problem: Problem) -> Decision:
    """llama.cpp ``--cpu-moe`` (kTransformers places the same way): ``n_cpu_moe`` with N = every
    layer: every routed expert in DRAM, everything else but the token embeddings on the GPU."""
    return n_cpu_moe(problem, problem.model.n_layers)


def n_cpu_moe(problem: Problem, n: int | None = None) -> Decision:
    """llama.cpp ``--n-cpu-moe N`` with all layers offloaded (``-ngl`` at its default, every
    layer): the routed-expert tensors (``blk.<il>.ffn_*_exps``) of layers ``il < N`` in DRAM,
    every other weight (attention, KV caches, routers, shared experts, dense layers, the output
    layer) on the GPU, the token embeddings in DRAM. Executed as ``_llama_cpp`` says: decode
    computes host-resident experts on the CPU beside the GPU; prefill of 32+ tokens copies
    them up and computes them on the GPU. ``n=None`` picks the smallest N that fits the GPU
    budget (what one tunes by hand; ``--fit`` is off when tensor overrides are given).

    Leaves out: ``--fit``'s own rule for MoE models (experts of the last layers in DRAM, a
    partial layer at the boundary)."""
    _need_experts(problem, "n-cpu-moe")
    if not problem.has_gpu:
        return all_cpu(problem)
    spec = problem.model
    if n is None:
        for k in range(spec.n_layers + 1):
            dec = n_cpu_moe(problem, k)
            if _gpu_bytes(problem, dec) <= problem.gpu_budget_bytes:
                return dec
        return n_cpu_moe(problem, spec.n_layers)
    if n < 0:
        raise HetplanError(f"--strategy n-cpu-moe:{n}: N must be >= 0")
    on_gpu = {b.name for b in problem.blocks if b.kind != "embed"}
    experts = {b.name: 0 if b.layer < n else spec.n_experts for b in problem.blocks if b.kind == "moe"}
    kv = {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}
    return _llama_cpp(problem, on_gpu, kv, experts)


def ktransformers(problem: Problem) -> Decision:
    """kTransformers 0.2's placement and execution for MoE models (its DeepSeek-V3 rule file:
    routed experts ``KExpertsCPU``, attention, KV cache, routers, shared experts and dense
    layers on the GPU, token embeddings on the CPU): ``cpu_moe``'s placement, but the CPU
    computes its experts in both phases; prefill never copies them to the GPU.

    Leaves out: kTransformers' CUDA graphs (one launch per decode step, so its per-task GPU
    cost is lower than llama.cpp's), its NUMA expert duplication on two sockets (the node's
    DRAM bandwidth is what the node.yaml says), and the Marlin GPU kernels' own efficiency."""
    _need_experts(problem, "ktransformers")
    if not problem.has_gpu:
        return all_cpu(problem)
    on_gpu = {b.name for b in problem.blocks if b.kind != "embed"}
    experts = {b.name: 0 for b in problem.blocks if b.kind == "moe"}
    kv = {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}
    return _llama_cpp(problem, on_gpu, kv, experts, offload=False)


# -- FlexGen ------------------------------------------------------------------------------------

def stream(problem: Problem) -> Decision:
    """FlexGen/ZeRO-Inference: every weight in pinned DRAM, prefetched one block ahead into two
    staging slots (depth 2); KV caches on the GPU when they fit with the slots, else in DRAM."""
    if not problem.has_gpu:
        return all_cpu(problem)
    weights = {b.name: "stream" if b.streamable else "cpu" for b in problem.blocks}
    kv = _kv_beside_staging(problem, weights)
    return _decision(problem, weights, kv, depth=2)


def flexgen(problem: Problem, gpu_percent: int | None = None) -> Decision:
    """FlexGen (FlexLLMGen ``flex_opt.py``) with ``--percent W 100-W C 100-C 0 100`` and
    ``--cpu-cache-compute``: W% of the weights in HBM, the rest in pinned DRAM, loaded layer by
    layer to the GPU one layer ahead of use (``load_weight(i, j + 1, k)`` on its own stream
    while layer ``j`` computes: staging depth 2), every layer computed on the GPU.

    Weights: ``init_weight_list`` places each tensor of a FlexGen layer (attention: q, k, v, out;
    MLP: fc1, fc2) by the mid-point of its cumulative size within the layer, in the order
    (disk, CPU, GPU): a tensor is in HBM when ``(cumsum - size / 2) / total >= 1 - W / 100``.
    So W = 4 keeps none of OPT's matrices in HBM (the last, ``w_out``, has its mid-point at
    87.5%). A block here is resident or not as a whole: the blocks are made resident, spread
    evenly in model order, so that their bytes come nearest to the bytes FlexGen's rule keeps
    in HBM (the same bytes cross PCIe per step). The token-embedding gather runs on the CPU.

    KV cache (``C``, all or nothing): on the GPU when it fits beside the resident weights, the
    two staging slots and the workspace, else in DRAM (C = 0). With the cache in DRAM, prefill
    computes attention on the GPU and copies the new K/V down (``store_cache``); decode
    computes attention on the CPU beside the cache (``cpu_cache_compute``: only q, k, v of the
    new token and the attention output cross PCIe). That CPU attention copies the cache before
    it reads it (``load_cache`` path 1 copies the cache into an fp32 workspace: read c bytes,
    write 4 per element; ``mha_gen`` then ``permute``s K and V and ``reshape``s them into
    contiguous copies: read 4, write 4; ``bmm`` reads those: 4), so it moves c + 16 bytes per
    element where hetplan's reads c in place: ``cpu_attention_bytes_per_cache_byte`` = (c + 16) / c
    (``flexgen_attention_bytes_per_cache_byte``; 9 for an fp16 cache). ``gpu_percent=None`` takes
    the largest W (in steps of 5) whose plan fits the GPU budget.

    Leaves out: the norms and biases (FlexGen places them by the same rule; a few KB); the
    zig-zag block schedule (a block of ``num_gpu_batches`` GPU batches shares one weight load,
    with a ``torch.cuda.synchronize`` after each layer and GPU batch, so a layer's weight load
    overlaps only the first GPU batch's compute: here the whole batch is one GPU batch and the
    load overlaps the whole layer); activations homed in DRAM (``--percent`` A = 0: each
    layer's hidden states copied down and back up); the fp32 softmax and output of the CPU
    attention (a few bytes per cached token and head, beside 9 per cache byte); the disk tier;
    compression (``--compress-weight``)."""
    if not problem.has_gpu:
        return all_cpu(problem)
    if gpu_percent is None:
        for w in range(100, -1, -5):
            dec = flexgen(problem, w)
            if _gpu_bytes(problem, dec) <= problem.gpu_budget_bytes:
                return dec
        return flexgen(problem, 0)
    if not 0 <= gpu_percent <= 100:
        raise HetplanError(f"--strategy flexgen:{gpu_percent}: the GPU weight percent W must be 0 to 100 "
                           f"(FlexGen's first --percent value); omit it for the largest that fits")
    weights = {b.name: "stream" if b.streamable else "cpu" for b in problem.blocks}
    target = resident = 0.0
    for b in problem.blocks:
        if not b.streamable:
            continue
        target += flexgen_gpu_fraction(problem.model.linear_shapes(b.kind), gpu_percent) * b.weight_bytes
        if resident + b.weight_bytes / 2 <= target:
            weights[b.name], resident = "gpu", resident + b.weight_bytes
    kv = _kv_beside_staging(problem, weights)
    dec = _decision(problem, weights, kv, depth=2)
    if "cpu" not in kv.values():
        return dec
    return dataclasses.replace(dec, cpu_attention_bytes_per_cache_byte=flexgen_attention_bytes_per_cache_byte(
        problem.model))


def flexgen_attention_bytes_per_cache_byte(spec) -> float:
    """(c + 16) / c, c = the cache's bytes per element: FlexGen's CPU decode attention reads the
    cache (c), writes it into an fp32 workspace (4), reads that (4) into contiguous permuted K
    and V (4), which ``bmm`` reads (4)."""
    c = spec.kv_bytes_per_token() / spec.kv_elems_per_token()
    return (c + 16.0) / c


def flexgen_gpu_fraction(shapes: list, gpu_percent: float) -> float:
    """The fraction of a layer's matrix bytes FlexGen's ``init_weight_list`` puts in HBM: tensor
    i is there when its cumulative mid-point ``(cumsum_i - size_i / 2) / total`` is at least
    ``1 - gpu_percent / 100`` (the GPU is the last of disk, CPU, GPU)."""
    sizes = [r * c for r, c in shapes]
    total = sum(sizes)
    if not total:
        return gpu_percent / 100
    on_gpu, cum = 0, 0
    for size in sizes:
        cum += size
        if (cum - size / 2) / total >= 1 - gpu_percent / 100:
            on_gpu += size
    return on_gpu / total


def _kv_beside_staging(problem: Problem, weights: dict) -> dict:
    """KV caches on the GPU when they fit beside the resident weights, two staging slots and the
    workspace; else in DRAM (attention without a separate core stage, ONNX blocks, then
    computes beside its cache, on the CPU: ``weights`` is updated)."""
    blocks = problem.blocks
    resident = sum(b.weight_bytes for b in blocks if weights[b.name] == "gpu")
    streamed = [b.weight_bytes for b in blocks if weights[b.name] == "stream"]
    slots = 2 * max(streamed, default=0.0)
    kv_total = sum(b.kv_bytes for b in blocks)
    on_gpu = resident + slots + kv_total + problem.gpu_workspace_bytes <= problem.gpu_budget_bytes
    if not on_gpu:
        split = {st.block for st in problem.graph.stages["decode"] if st.follows == "kv"}
        weights.update({b.name: "cpu" for b in blocks if b.kind == "attn" and b.name not in split})
    return {b.name: "gpu" if on_gpu else "cpu" for b in blocks if b.kind == "attn"}


def _need_experts(problem: Problem, name: str) -> None:
    if not problem.model.is_moe:
        raise HetplanError(f"--strategy {name}: model {problem.model.name!r} has no experts; "
                           f"use ngl, ngl-nkvo, greedy, stream or all-gpu")


def _gpu_bytes(problem: Problem, dec: Decision) -> float:
    from hetplan.evaluate import memory_report
    return memory_report(problem, dec)[0]["gpu_bytes"]


BASELINES = {"all-gpu": all_gpu, "greedy": greedy, "ngl": ngl, "ngl-nkvo": ngl_nkvo, "stream": stream,
             "flexgen": flexgen}
"""Baselines for every model."""
MOE_BASELINES = {"cpu-moe": cpu_moe, "n-cpu-moe": n_cpu_moe, "ktransformers": ktransformers}
"""Baselines for mixture-of-experts models only."""


def applicable(problem: Problem) -> dict:
    """name -> baseline function, for the baselines that apply to ``problem``'s model."""
    return {**BASELINES, **MOE_BASELINES} if problem.model.is_moe else dict(BASELINES)


def best_fitting(problem: Problem) -> tuple:
    """(name, decision, objective in s) of the baseline with the least objective among those
    whose plans fit the node's budgets; (None, None, inf) when none fits. Each baseline is
    decided as ``--strategy NAME`` compiles it: with the HBM ``problem`` holds back (none, the
    first time compile solves), then again with more held back while its plan overflows by what
    its copies to the host leave waiting (``hetplan.evaluate.plan_within_budget``)."""
    from hetplan.evaluate import HELD_BACK_ROUNDS, memory_report, objective_s, predictions, with_copies_out
    from hetplan.schedule import build_schedule

    best = (None, None, float("inf"))
    node_gpu = (problem.gpu_budget_bytes + problem.gpu_held_back_bytes) * (1 + 1e-9)
    for name, fn in applicable(problem).items():
        p = problem
        for _ in range(HELD_BACK_ROUNDS):
            dec = fn(p)
            mem = memory_report(p, dec)[0]
            if mem["gpu_bytes"] > p.gpu_budget_bytes or mem["cpu_bytes"] > p.cpu_budget_bytes:
                break
            schedule = build_schedule(p, dec)
            held = with_copies_out(mem, p, schedule)["breakdown"]["gpu"]["copies_out"]
            if mem["gpu_bytes"] + held <= node_gpu:
                obj = objective_s(p, predictions(p, schedule))
                if obj < best[2]:
                    best = (name, dec, obj)
                break
            if held <= p.gpu_held_back_bytes:
                break
            p = problem.held_back(held)
    return best
