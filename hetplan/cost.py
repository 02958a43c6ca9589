"""The cost model: bytes and FLOPs in, seconds out. No solver, no plan, no torch.

Every formula is a small function whose docstring states it. Times follow a roofline: a task
takes ``max(flops / (peak * eff_flops), bytes / (bandwidth * eff_mem)) + tasks * latency``, where
``latency`` is a fixed per-task cost (kernel launches, dispatch) and ``tasks`` the rounds a
chunked prefill stage runs (one per chunk). Transfers take
``bytes / (link * eff_link) + latency``. Measured profile tables, when present, replace the
analytic time of an op (see ``hetplan.profile.table``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.dtypes import QUANTISED, compute_dtype
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec


@dataclass(frozen=True)
class Work:
    """What one compute task does: FLOPs, bytes read from the memory it runs next to, and the
    op name and shape a profile table is keyed by."""
    flops: float
    bytes: float
    op: str = "linear"
    tokens: int = 1
    tasks: int = 1
    """Kernel rounds the task issues (a chunked prefill stage runs once per chunk): each pays the
    fixed per-task latency."""


def activation_bytes_per_elem(spec: ModelSpec) -> int:
    """Activations are kept in fp32 for fp32 weights, else in 16-bit."""
    return 4 if spec.weight_dtype == "fp32" else 2


def roofline_seconds(flops: float, nbytes: float, peak_flops: float, bandwidth: float,
                     eff_flops: float, eff_mem: float, latency: float) -> float:
    """t = max(flops / (peak * eff_flops), bytes / (bandwidth * eff_mem)) + latency."""
    return max(flops / (peak_flops * eff_flops), nbytes / (bandwidth * eff_mem)) + latency


def gpu_seconds(work: Work, spec: ModelSpec, hw: HardwareSpec) -> float:
    """Roofline time of ``work`` on the GPU (HBM bandwidth, tensor-core peak of the compute dtype),
    one latency per task round."""
    g, eff = hw.gpu, hw.efficiency
    return roofline_seconds(work.flops, work.bytes, g.peak_flops(compute_dtype(spec.weight_dtype)),
                            g.mem_bytes_per_s, eff["gpu_flops"], eff["gpu_mem"],
                            work.tasks * hw.latency_s["gpu_task"])


def cpu_seconds(work: Work, spec: ModelSpec, hw: HardwareSpec) -> float:
    """Roofline time of ``work`` on the CPU (DRAM bandwidth; fp32 peak for fp32 weights, else bf16),
    one latency per task round."""
    c, eff = hw.cpu, hw.efficiency
    dtype = "fp32" if spec.weight_dtype == "fp32" else "bf16"
    return roofline_seconds(work.flops, work.bytes, c.peak_flops(dtype), c.mem_bytes_per_s,
                            eff["cpu_flops"], eff["cpu_mem"], work.tasks * hw.latency_s["cpu_task"])


def h2d_seconds(nbytes: float, hw: HardwareSpec) -> float:
    """t = bytes / (h2d * eff_link) + latency: pinned host-to-device copy."""
    return nbytes / (hw.h2d_bytes_per_s * hw.efficiency["link"]) + hw.latency_s["link_task"]


def d2h_seconds(nbytes: float, hw: HardwareSpec) -> float:
    """t = bytes / (d2h * eff_link) + latency: device-to-host copy."""
    return nbytes / (hw.d2h_bytes_per_s * hw.efficiency["link"]) + hw.latency_s["link_task"]


# -- work of each op ----------------------------------------------------------------------------

def linear_work(tokens: int, params: float, spec: ModelSpec, op: str = "linear") -> Work:
    """y = x W for ``tokens`` rows: flops = 2 * tokens * params; bytes = params * bytes/weight
    + activations in and out (2 * tokens * hidden * act_bytes)."""
    act = activation_bytes_per_elem(spec)
    return Work(flops=2.0 * tokens * params,
                bytes=params * spec.weight_bytes_per_param + 2.0 * tokens * spec.hidden * act,
                op=op, tokens=tokens)


def attention_prefill_work(batch: int, prompt_len: int, spec: ModelSpec, chunks: tuple | None = None) -> Work:
    """Causal attention over the prompt in chunks ((start s_i, length c_i), ...; None: one chunk).
    The first chunk is causal over itself (c_0 (c_0 + 1) / 2 query-key pairs); a later chunk
    attends over its whole prefix through a mask (c_i (s_i + c_i) pairs, all computed).
    flops = 4 * batch * heads * d_qk * pairs (QK^T and PV); bytes = write the prompt's KV
    (batch * P * kv_bytes_per_token) + read q and write the output (batch * P * (q_dim +
    out_dim) * act) + per later chunk, re-read the prefix's K/V activations (batch * s_i *
    kv_elems * act) and its mask (c_i (s_i + c_i) * (1 + act): boolean and additive)."""
    act = activation_bytes_per_elem(spec)
    chunks = chunks or ((0, prompt_len),)
    pairs = chunks[0][1] * (chunks[0][1] + 1) / 2 + sum(c * (s + c) for s, c in chunks[1:])
    flops = 4.0 * batch * spec.n_heads * spec.head_dim * pairs
    nbytes = batch * prompt_len * (spec.kv_bytes_per_token() + (spec.q_dim + spec.attn_out_dim) * act)
    nbytes += sum(batch * s * spec.kv_elems_per_token() * act + c * (s + c) * (1 + act) for s, c in chunks[1:])
    return Work(flops=flops, bytes=nbytes, op="attention_prefill", tokens=batch * prompt_len,
                tasks=len(chunks))


def attention_decode_work(batch: int, context: float, spec: ModelSpec) -> Work:
    """One new token per sequence attending over ``context`` cached tokens:
    flops = 4 * batch * heads * d * context, with d = head_dim (MLA with absorbed weights:
    d = kv_lora_rank + qk_rope_head_dim); bytes = batch * context * kv_bytes_per_token
    (reading the cache dominates)."""
    d = (spec.kv_lora_rank + spec.qk_rope_head_dim) if spec.is_mla else spec.head_dim
    flops = 4.0 * batch * spec.n_heads * d * context
    return Work(flops=flops, bytes=batch * context * spec.kv_bytes_per_token(),
                op="attention_decode", tokens=batch)


def expected_distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """E[# experts hit by ``tokens`` tokens each choosing top_k of n uniformly]
    = n * (1 - (1 - k/n)^tokens)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def moe_work(tokens: int, spec: ModelSpec, fractions: tuple | None = None) -> Work:
    """An MoE layer: flops = 2 * tokens * active params; bytes = shared weights + the expected
    number of distinct experts the batch touches * expert bytes (``expert_read_bytes``), where expert e with routing
    fraction f_e is touched with probability 1 - (1 - f_e)^tokens (uniform f = k / n gives
    n * (1 - (1 - k/n)^tokens), ``expected_distinct_experts``)."""
    act = activation_bytes_per_elem(spec)
    l = spec.first_dense_layers
    if fractions is None:
        distinct = expected_distinct_experts(spec.n_experts, spec.experts_per_token, tokens)
    else:
        distinct = sum(1.0 - (1.0 - min(f, 1.0)) ** tokens for f in fractions)
    weights = spec.moe_shared_params() * spec.weight_bytes_per_param + distinct * spec.expert_read_bytes()
    return Work(flops=2.0 * tokens * spec.mlp_active_params(l),
                bytes=weights + 2.0 * tokens * spec.hidden * act,
                op="moe", tokens=tokens)


def embed_work(tokens: int, spec: ModelSpec) -> Work:
    """Embedding gather: reads tokens * hidden weights (fp16 when the model is quantised: lookup
    tables are kept unquantised), no FLOPs."""
    wb = 2.0 if spec.weight_dtype in QUANTISED else spec.weight_bytes_per_param
    return Work(flops=0.0, bytes=tokens * spec.hidden * (wb + activation_bytes_per_elem(spec)),
                op="embed", tokens=tokens)


def peer_seconds(nbytes: float, hw: HardwareSpec, a: int, b: int) -> float:
    """Activations from GPU ``a`` to GPU ``b``: over a peer link (NVLink, NVSwitch, PCIe
    peer-to-peer) ``t = bytes / (bw * eff_link) + latency``; through the host, a copy out and
    one back in, ``t = d2h_seconds(bytes) + h2d_seconds(bytes)``."""
    link = hw.peer(a, b)
    if link.kind == "host":
        return d2h_seconds(nbytes, hw) + h2d_seconds(nbytes, hw)
    return nbytes / (link.bytes_per_s * hw.efficiency["link"]) + hw.latency_s["link_task"]
