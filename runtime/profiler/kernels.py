"""What the profiler times: each measurement as a zero-argument call plus the work it does.

A ``Kernel`` is one (device, op, dtype, shape, x) point to time: ``setup()`` allocates its
tensors and returns the call to time, ``work`` is its FLOPs and bytes under the cost model's
formulas (``hetplan.cost``, ``hetplan.graph``), so a measured point and a planned stage of the
same size sit at the same coordinate of the table. The points of one group (the stages of one
block, or one shape of the grid) reuse the weights their first point allocated; each call reads
its operands cold (``copies``), as a forward pass through many layers does.

Stage kernels run the runtime's own backend (``backend.run``) on random weights, so the table
holds what ``hetplan exec`` will execute; the standard grid runs plain torch GEMMs and
``scaled_dot_product_attention``. A quantised dtype (``QUANTISED``) is measured as the runtime
runs it: its weights quantised into the packed bytes the runtime places (``packed_layout``) and
multiplied by the packed kernels (``hetplan.runtime.kernels.linear``), activations in the
dtype the runtime dequantises into on that device (``quant.compute_dtype``). Knows nothing
about budgets, repeats or files.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hetplan import cost
from hetplan.cost import Work
from hetplan.graph import block_graph
from hetplan.model import ModelSpec
from hetplan.profile.table import linear_shape, shape_key
from hetplan.dtypes import row_bytes
from hetplan.runtime.devices import placed_empty
from hetplan.runtime.kernels import quant
from hetplan.runtime.kernels.linear import PackedLinear, linear
from hetplan.runtime.profiler.machine import cache_bytes
from hetplan.runtime.weights import TORCH_DTYPES
from hetplan.workload import Workload

QUANTISED = quant.FORMATS
"""Weight formats the runtime keeps packed: profiled by their packed kernels."""

TOKEN_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
"""Rows of the linear stages (decode batch, or batch * prompt in prefill)."""
HEAD_MAX_ROWS = 64
"""The head computes logits for the last position of each sequence only: its rows are a batch."""
DECODE_CONTEXTS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Cached tokens a decode step attends over (batch 1)."""
PREFILL_PROMPTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
"""Prompt lengths of prefill attention (batch 1)."""
LINEAR_GRID = ((1024, 4096), (4096, 4096))
"""Standard weight shapes [k, n] of the plain GEMM grid, timed at ``LINEAR_TOKENS`` rows."""
LINEAR_TOKENS = (1, 8, 64, 512)
STANDARD_ATTENTION = (32, 8, 128)
"""heads, kv heads, head_dim of the standard attention grid (Llama-3-8B's)."""


@dataclass(frozen=True)
class Kernel:
    device: str
    op: str
    dtype: str
    shape: str
    x: float
    work: Work
    group: str
    """Kernels of one group share the tensors ``setup`` makes (cached by the caller)."""
    setup: Callable[[dict], Callable[[], object]]
    """Given the group's cache dict, allocate what is missing and return the call to time."""
    grid: bool = False
    """Part of the standard grid (plain torch ops), not a model's own stage."""


def _rand(shape, dtype, device, scale=0.05) -> torch.Tensor:
    """Uniform in [-scale, scale), in memory placed as the runtime places weights and caches."""
    return placed_empty(tuple(shape), dtype, torch.device(device)).uniform_(-scale, scale)


def _placed_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory placed as the runtime places weights (``placed_empty``)."""
    return placed_empty(tuple(t.shape), t.dtype, t.device).copy_(t)


def copies(device: str, nbytes: float) -> int:
    """How many copies of an operand of ``nbytes`` to cycle through so that every call reads it
    from memory, as a forward pass does (each layer's weights are cold), rather than from the
    cache the previous call warmed: enough to cover twice the cache, at most 64."""
    return max(1, min(64, math.ceil(2 * cache_bytes(device) / max(nbytes, 1.0))))


def cycling(calls: list) -> Callable[[], object]:
    """One call that runs ``calls`` in turn."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


# -- standard grid ------------------------------------------------------------------------------

def compute_dtype(device: str, dtype: str) -> str:
    """The dtype the arithmetic of ``dtype`` weights runs in on ``device``: their own, or for a
    quantised format the one the runtime dequantises into there (fp32 on the CPU, bf16 on CUDA)."""
    if dtype not in QUANTISED:
        return dtype
    return "bf16" if quant.compute_dtype("cuda" if device == "gpu" else "cpu") == torch.bfloat16 else "fp32"


def runtime_gemm(device: str, dtype: str) -> bool:
    """Whether ``dtype`` weights are timed through the runtime's ``linear`` rather than torch's
    GEMM: 16-bit weights on the CPU, which the runtime upcasts (a tile at a time where the CPU
    has no 16-bit GEMMs, per block of 32 at decode), so that the rate priced is the rate run."""
    return device == "cpu" and dtype in ("bf16", "fp16")


def linear_kernels(device: str, dtype: str) -> list[Kernel]:
    """GEMM/GEMV y = x @ W^T for each standard shape and row count: plain torch for fp32 and
    16-bit weights on a GPU, the runtime's ``linear`` for a quantised format and for 16-bit
    weights on the CPU (``runtime_gemm``); work as
    ``cost.linear_work`` counts it (2 * rows * k * n FLOPs; weight bytes as stored, scales
    included, + activations)."""
    act = TORCH_DTYPES[compute_dtype(device, dtype)]
    dev = torch.device(_torch_device(device))
    out = []
    for k, n in LINEAR_GRID:
        wbytes = row_bytes(dtype, k) * n
        for rows in LINEAR_TOKENS:
            def setup(cache, k=k, n=n, rows=rows, wbytes=wbytes):
                if "w" not in cache:
                    cache["w"] = _grid_weights(dtype, n, k, dev, copies(device, wbytes))
                x = _rand((rows, k), act, dev, 1.0)
                if dtype in QUANTISED or runtime_gemm(device, dtype):
                    return cycling([lambda w=w: linear(x, w) for w in cache["w"]])
                return cycling([lambda w=w: x @ w.T for w in cache["w"]])
            work = Work(flops=2.0 * rows * k * n, bytes=wbytes + rows * (k + n) * act.itemsize, op="linear",
                        tokens=rows)
            out.append(Kernel(device, "linear", dtype, linear_shape(k, n), rows, work,
                              f"{device}/linear/{dtype}/{k}x{n}", setup, grid=True))
    return out


def _grid_weights(dtype: str, n: int, k: int, dev, count: int) -> list:
    """``count`` copies of one random [n, k] weight: tensors, or ``PackedLinear`` over packed
    bytes for a quantised format (quantised once, the bytes copied)."""
    if dtype not in QUANTISED:
        return [_rand((n, k), TORCH_DTYPES[dtype], dev) for _ in range(count)]
    packed = quant.quantise(dtype, _rand((n, k), torch.float32, dev))
    return [PackedLinear(dtype, k, (quant.split(dtype, _placed_copy(packed), (n, k)),)) for _ in range(count)]


def attention_kernels(device: str, dtype: str) -> list[Kernel]:
    """Decode attention (one query per sequence over a KV cache of ``c`` tokens) and causal
    prefill attention, with ``scaled_dot_product_attention`` at the standard head shape; work
    as ``cost.attention_decode_work`` / ``attention_prefill_work`` count it."""
    h, kvh, hd = STANDARD_ATTENTION
    spec = _attention_spec(h, kvh, hd, dtype)
    dt, dev = TORCH_DTYPES[dtype], torch.device(_torch_device(device))
    shape = shape_key("attention_decode", spec)
    out = []
    for c in DECODE_CONTEXTS:
        def setup(cache, c=c):
            q = _rand((1, h, 1, hd), dt, dev, 1.0)
            n = copies(device, 2 * kvh * c * hd * dt.itemsize)
            kvs = [(_rand((1, kvh, c, hd), dt, dev, 1.0), _rand((1, kvh, c, hd), dt, dev, 1.0)) for _ in range(n)]
            return cycling([lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                            for k, v in kvs])
        w = cost.attention_decode_work(1, c, spec)
        out.append(Kernel(device, "attention_decode", dtype, shape, c, w, f"{device}/adec/{dtype}", setup, grid=True))
    for p in PREFILL_PROMPTS:
        def setup(cache, p=p):
            q = _rand((1, h, p, hd), dt, dev, 1.0)
            k, v = _rand((1, kvh, p, hd), dt, dev, 1.0), _rand((1, kvh, p, hd), dt, dev, 1.0)
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        w = cost.attention_prefill_work(1, p, spec)
        out.append(Kernel(device, "attention_prefill", dtype, shape, p * (p + 1) / 2, w,
                          f"{device}/apre/{dtype}", setup, grid=True))
    return out


def _attention_spec(h: int, kvh: int, hd: int, dtype: str) -> ModelSpec:
    return ModelSpec(name="standard-attention", arch="llama", n_layers=1, hidden=h * hd, intermediate=1,
                     n_heads=h, n_kv_heads=kvh, head_dim=hd, vocab=1, max_positions=1 << 20,
                     weight_dtype=dtype, kv_dtype=dtype)


# -- the runtime's own stages --------------------------------------------------------------------

def stage_kernels(spec: ModelSpec, device: str) -> list[Kernel]:
    """Every stage of ``spec`` as the runtime's backend executes it: the linear stages and the
    embedding at ``TOKEN_GRID`` rows (a decode step of that batch), ``attn_core`` as decode
    attention at ``DECODE_CONTEXTS`` and as prefill attention at ``PREFILL_PROMPTS``."""
    from hetplan.runtime.backend import Step, StageCall, backend_for

    backend = backend_for(spec)
    dtype = spec.weight_dtype
    dt, dev = TORCH_DTYPES[compute_dtype(device, dtype)], torch.device(_torch_device(device))
    backend.dtype = dt        # as run_plan sets it for a quantised plan
    kv_dt = TORCH_DTYPES[spec.kv_dtype]
    fused = backend.fused() if hasattr(backend, "fused") else {}
    max_tokens = min(spec.max_positions, max(TOKEN_GRID + DECODE_CONTEXTS + PREFILL_PROMPTS))
    kinds = {"embed": "embed", "attn_in": "attn", "attn_out": "attn", "mlp": "mlp", "head": "head"}
    fp = spec.fingerprint()

    def weights(cache, block_kind) -> list:
        """Copies of one block's weights (``copies``), made once per group."""
        key = ("w", block_kind)
        if key not in cache:
            backend.setup(dev, max_tokens)
            specs = backend.block_tensors(_block_name(block_kind), block_kind, _layer(block_kind))
            if dtype in QUANTISED:
                cache[key] = _packed_blocks(dtype, specs, dt, dev, fused, getattr(backend, "expert_of", None),
                                            device)
            else:
                nbytes = sum(math.prod(t.shape) for t in specs) * dt.itemsize
                cache[key] = [{t.local: _initial(t, dt, dev) for t in specs} for _ in range(copies(device, nbytes))]
        return cache[key]

    def run(kind, block_kind, weight_sets, inputs, step, kvs=(None,)):
        """A call cycling through every weight set and KV cache copy."""
        n = max(len(weight_sets), len(kvs))
        calls = [StageCall(kind=kind, block=_block_name(block_kind), layer=_layer(block_kind), device=dev,
                           weights=weight_sets[i % len(weight_sets)], inputs=inputs, step=step,
                           kv=kvs[i % len(kvs)]) for i in range(n)]
        return cycling([lambda c=c: backend.run(c) for c in calls])

    def inputs(kind, batch, tokens):
        return {name: _value(name, spec, batch, tokens, dt, dev) for name in backend.reads(kind)}

    out = []
    for tokens in TOKEN_GRID:
        works = _stage_works(spec, tokens)
        for kind, block_kind in kinds.items():
            if kind == "head" and tokens > HEAD_MAX_ROWS:
                continue

            def setup(cache, kind=kind, block_kind=block_kind, tokens=tokens):
                return run(kind, block_kind, weights(cache, block_kind), inputs(kind, tokens, 1),
                           Step("decode", 0, 1, tokens))
            out.append(Kernel(device, kind, dtype, shape_key(kind, spec), tokens, works[kind],
                              f"{device}/{fp}/{block_kind}", setup))
    kv_shapes = backend.kv_shapes
    for c in DECODE_CONTEXTS:
        if c > spec.max_positions:
            continue

        def setup(cache, c=c):
            shapes = kv_shapes(1, c)
            n = copies(device, sum(math.prod(s) for s in shapes.values()) * kv_dt.itemsize)
            kvs = [{name: _rand(s, kv_dt, dev, 1.0) for name, s in shapes.items()} for _ in range(n)]
            return run("attn_core", "attn", [{}], inputs("attn_core", 1, 1), Step("decode", c - 1, 1, 1), kvs)
        w = cost.attention_decode_work(1, c, spec)
        out.append(Kernel(device, "attention_decode", dtype, shape_key("attention_decode", spec), c, w,
                          f"{device}/{fp}/attention", setup))
    for p in PREFILL_PROMPTS:
        if p > spec.max_positions:
            continue

        def setup(cache, p=p):
            kv = {name: torch.zeros(s, dtype=kv_dt, device=dev) for name, s in kv_shapes(1, p).items()}
            return run("attn_core", "attn", [{}], inputs("attn_core", 1, p), Step("prefill", 0, p, 1), (kv,))
        w = cost.attention_prefill_work(1, p, spec)
        out.append(Kernel(device, "attention_prefill", dtype, shape_key("attention_prefill", spec),
                          p * (p + 1) / 2, w, f"{device}/{fp}/attention", setup))
    return out


def _initial(t, dt, dev) -> torch.Tensor:
    """A block tensor's random value (norm weights 1)."""
    return placed_empty(tuple(t.shape), dt, dev).fill_(1.0) if "norm" in t.local else _rand(t.shape, dt, dev)


def _packed_blocks(fmt: str, specs: list, dt, dev, fused: dict, expert_of, device: str) -> list:
    """Copies (``copies``) of one block as the runtime places a quantised block: its bytes in
    ``packed_layout`` (linears quantised, the other tensors raw) and a ``PackedView`` over them
    with its own dequantisation buffer; what a stage computes with (``materialise``)."""
    from hetplan.runtime.kernels.packed import PackedView, packed_layout, views

    layout = packed_layout(fmt, specs, dt, expert_of)
    flat = placed_empty((layout.nbytes,), torch.uint8, dev)
    linears = [t for t in specs if quant.quantises(t.local, t.shape)]
    others = [t for t in specs if not quant.quantises(t.local, t.shape)]
    for (local, off, shape, n), t in zip(layout.packed, linears):
        flat[off:off + n].copy_(quant.quantise(fmt, _rand(quant.stored_shape(local, shape), torch.float32, dev)))
    raw = views(flat[layout.raw_offset:].view(layout.raw_dtype), layout.raw, {})
    for t in others:
        raw[t.local].copy_(_initial(t, layout.raw_dtype, dev))
    out = []
    for i in range(copies(device, layout.nbytes)):
        mine = flat if i == 0 else _placed_copy(flat)
        buffer = torch.empty(layout.buffer_numel, dtype=dt, device=dev)
        out.append(PackedView(fmt, mine, layout, buffer, fused).materialise())
    return out


def _block_name(block_kind: str) -> str:
    return {"attn": "attn_0", "mlp": "mlp_0"}.get(block_kind, block_kind)


def _layer(block_kind: str) -> int | None:
    return 0 if block_kind in ("attn", "mlp") else None


def _stage_works(spec: ModelSpec, tokens: int) -> dict:
    """Work of each stage kind of a decode step of batch ``tokens``, exactly as the planner's
    block graph prices it (every linear stage then runs on ``tokens`` rows)."""
    g = block_graph(spec, Workload(batch=tokens, prompt_len=1, gen_len=1))
    works = {}
    for st in g.stages["decode"]:
        works.setdefault(st.kind, st.work)
    return works


def _value(name: str, spec: ModelSpec, batch: int, tokens: int, dt, dev) -> torch.Tensor:
    """A random activation of the dense backends' value ``name`` (see ``runtime.backend``)."""
    shapes = {"x": (batch, tokens, spec.hidden), "q": (batch, tokens, spec.n_heads, spec.head_dim),
              "k": (batch, tokens, spec.n_kv_heads, spec.head_dim),
              "v": (batch, tokens, spec.n_kv_heads, spec.head_dim),
              "o": (batch, tokens, spec.n_heads * spec.head_dim)}
    if name == "ids":
        return torch.randint(0, spec.vocab, (batch, tokens), device=dev)
    return _rand(shapes[name], dt, dev, 1.0)


def _torch_device(device: str) -> str:
    return "cuda" if device == "gpu" else "cpu"
