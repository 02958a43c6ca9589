"""The block graph: a model cut into placeable blocks, and each phase's chain of stages.

A *block* is the unit of placement (``embed``, per layer ``attn_l`` and ``mlp_l``/``moe_l``,
``head``): it owns weights that live in one tier. A *stage* is one compute task of a phase's
forward pass; an attention block has three (``attn_in``: norm + QKV projections, ``attn_core``:
attention over the KV cache, ``attn_out``: output projection + residual) so that decode
attention can run where the KV cache lives while the projections run where the weights are.
Stages form a chain (each consumes the previous one's activations).

This module knows shapes, FLOPs and bytes; it knows nothing about machines or seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from hetplan import cost
from hetplan.cost import Work
from hetplan.dtypes import DEQUANT_BYTES, QUANTISED, bytes_per_element
from hetplan.model import ModelSpec
from hetplan.workload import Workload

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Block:
    name: str
    kind: str
    """``embed``, ``attn``, ``mlp``, ``moe`` or ``head``."""
    layer: int | None
    weight_bytes: float
    kv_bytes: float = 0.0
    """KV cache of this attention block for the full context of every sequence."""
    kv_bytes_per_token: float = 0.0
    streamable: bool = True
    """False for the embedding: a gather reads a few rows, streaming the table is never useful."""


@dataclass(frozen=True)
class Stage:
    block: str
    kind: str
    """``embed``, ``attn_in``, ``attn_core``, ``attn_out``, ``mlp``, ``moe`` or ``head``."""
    work: Work
    in_bytes: float
    """Activation bytes entering this stage: what crosses PCIe when it runs on another device
    than the previous stage."""
    follows: str = "exec"
    """Which decision places the stage: ``exec`` (where its block executes) or ``kv`` (where
    its block's KV cache lives: decode attention runs beside the cache)."""

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.block}"


@dataclass(frozen=True)
class BlockGraph:
    model: ModelSpec
    workload: Workload
    blocks: tuple
    stages: dict
    """phase -> tuple of Stage, in execution order."""

    def block(self, name: str) -> Block:
        return self._index[name]

    @functools.cached_property
    def _index(self) -> dict:
        """name -> block, built on the first lookup."""
        return {b.name: b for b in self.blocks}


def block_graph(spec: ModelSpec, wl: Workload, routing=None) -> BlockGraph:
    """Cut ``spec`` into blocks and build the prefill and decode stage chains for ``wl``.
    ``routing`` (``hetplan.routing.RoutingStats``) gives MoE layers their expert fractions."""
    wb = spec.weight_bytes_per_param
    act = cost.activation_bytes_per_elem(spec)
    kv_tok = spec.kv_bytes_per_token()
    o_params = spec.attn_out_dim * spec.hidden + (spec.hidden if spec.attn_out_bias else 0)
    # Lookup tables are never quantised: a quantised model keeps them in fp16.
    embed_wb = bytes_per_element("fp16") if spec.weight_dtype in QUANTISED else wb
    embed_bytes = spec.block_bytes.get("embed", spec.embed_params() * embed_wb)
    blocks = [Block("embed", "embed", None, float(embed_bytes), streamable=False)]
    for l in range(spec.n_layers):
        blocks.append(Block(f"attn_{l}", "attn", l, spec.block_weight_bytes("attn", l),
                            kv_bytes=wl.batch * wl.context_len * kv_tok, kv_bytes_per_token=kv_tok))
        mlp_kind = "moe" if spec.is_moe_layer(l) else "mlp"
        blocks.append(Block(f"{mlp_kind}_{l}", mlp_kind, l, spec.block_weight_bytes(mlp_kind, l)))
    blocks.append(Block("head", "head", None, spec.block_weight_bytes("head")))
    rate = held_rates(spec, blocks)

    def lin(t: int, params: float, op: str, block: str) -> Work:
        """``cost.linear_work``, its weights read at the bytes per parameter ``block`` is held in."""
        w = cost.linear_work(t, params, spec, op)
        return w if block not in rate else dataclasses.replace(w, bytes=w.bytes + params * (rate[block] - wb))

    qkv_bytes = (spec.q_dim + spec.kv_elems_per_token()) * act
    stages = {}
    for phase in PHASES:
        tokens = wl.batch * (wl.prompt_len if phase == "prefill" else 1)
        pieces = [wl.batch * c for _, c in wl.chunks()] if phase == "prefill" else [wl.batch]

        def per_chunk(make) -> Work:
            return chunked(make, pieces)

        hidden_in = tokens * spec.hidden * act
        chain = [Stage("embed", "embed", cost.embed_work(tokens, spec), 0.0)]
        for b in blocks[1:-1]:
            l = b.layer
            if b.kind == "attn":
                core = (cost.attention_prefill_work(wl.batch, wl.prompt_len, spec, wl.chunks()) if phase == "prefill"
                        else cost.attention_decode_work(wl.batch, wl.decode_context_len, spec))
                chain += [
                    Stage(b.name, "attn_in", per_chunk(lambda t, b=b: lin(t, spec.attn_params() - o_params, "attn_in",
                                                                          b.name)), hidden_in),
                    Stage(b.name, "attn_core", core, tokens * qkv_bytes,
                          follows="kv" if phase == "decode" else "exec"),
                    Stage(b.name, "attn_out", per_chunk(lambda t, b=b: lin(t, o_params, "attn_out", b.name)),
                          tokens * spec.attn_out_dim * act),
                ]
            elif b.kind == "moe":
                fr = routing.expert_fractions(l, spec) if routing is not None else None
                chain.append(Stage(b.name, "moe", per_chunk(lambda t, fr=fr: cost.moe_work(t, spec, fr)), hidden_in))
            else:
                chain.append(Stage(b.name, "mlp", per_chunk(lambda t, l=l, b=b: lin(t, spec.mlp_params(l), "mlp", b.name)),
                                   hidden_in))
        # Only the last position of each sequence needs logits.
        chain.append(Stage("head", "head", lin(wl.batch, spec.head_params(), "head", "head"),
                           wl.batch * spec.hidden * act))
        stages[phase] = tuple(chain)
    return BlockGraph(spec, wl, tuple(blocks), stages)


def held_rates(spec: ModelSpec, blocks: list) -> dict:
    """Bytes per parameter each dense block is held in when a file prices it tensor by tensor
    (``ModelSpec.block_bytes``: a GGUF file's mixed types), so that its stages read the bytes
    that are there: block bytes / block parameters, for attention, dense MLP and head blocks
    (an MoE block's routed experts are read at ``ModelSpec.expert_read_bytes``, the rest of it
    at ``weight_bytes_per_param``). Empty for every other spec."""
    if not spec.block_bytes:
        return {}
    params = {"attn": lambda b: spec.attn_params(), "mlp": lambda b: spec.mlp_params(b.layer),
              "head": lambda b: spec.head_params()}
    return {b.name: b.weight_bytes / params[b.kind](b) for b in blocks if b.kind in params}


def chunked(make, pieces: list) -> Work:
    """The work of a stage run once per prefill chunk: ``make(tokens)`` for each chunk's tokens
    (batch * c_i), FLOPs and bytes summed (a chunk re-reads the stage's weights), one task round
    per chunk; keyed for a profile table by the whole stage's tokens."""
    works = [make(t) for t in pieces]
    return dataclasses.replace(works[0], flops=sum(w.flops for w in works), bytes=sum(w.bytes for w in works),
                               tokens=sum(pieces), tasks=len(pieces))


def workspace_bytes(spec: ModelSpec, wl: Workload, device: str = "gpu") -> float:
    """Peak activation bytes of a forward pass on one device: the prefill's largest stage, plus
    with quantised weights the dequantisation buffer (``dequant_buffer_elems`` at
    ``DEQUANT_BYTES[device]`` each), plus what reading a KV cache block by block holds
    (``kv_read_bytes``).

    A stage holds values at full length t = batch * P (layer-major chunked prefill keeps the
    residual stream of the whole prompt) and temporaries for one chunk c = batch * C, each
    element ``e`` bytes (activation dtype); D hidden, q = q_dim, kv = kv_elems_per_token,
    o = attn_out_dim, I = mlp width (for MoE: moe_intermediate * experts_per_token, or the dense
    width when larger). With n chunks > 1 a token-wise stage's output is allocated whole and
    filled chunk by chunk (``[n > 1]`` below):

    - ``attn_in``: t (D + (q + kv) [n > 1]) held + c (D + (q + kv) (1 + [n > 1]) + 4 q): the
      normed input, the fused projection (and, chunked, q/k/v laid out per head before they are
      copied into the whole outputs), four rotary temporaries of q;
    - ``attn_core``: t (D + q + kv) held (chunked, each chunk's output overwrites its own
      queries) + c o (the kernel's output) + batch * heads * C * 4 (fp32 log-sum-exp) + for n > 1 the last chunk's mask,
      C * P * (1 + e) bytes (boolean, then additive in the compute dtype);
    - ``attn_out``: t (D + o + D [n > 1]) + c D;
    - ``mlp``/``moe``: t (D + D [n > 1]) + c (2 D + 3 I): normed input, gate and up, activation,
      down projection;
    - ``head`` (last position only): batch * (D (2 + 4 / e) + vocab) * e + batch * vocab * 4
      (logits in fp32) — small;
    - MLA (absorbed attention): t * heads * (2 kv_lora_rank + qk_rope_head_dim) held latent-space
      query and output, whole-prompt projections.
    Norm temporaries (fp32, 8 c D bytes plus the fp32 copy of a 16-bit input) precede the
    projections, so they count only when they exceed the projection phase."""
    e = cost.activation_bytes_per_elem(spec)
    t, c, chunk = wl.batch * wl.prompt_len, wl.batch * wl.chunk_len, wl.chunk_len
    whole = 1 if wl.n_chunks > 1 else 0
    d, q, kv, o = spec.hidden, spec.q_dim, spec.kv_elems_per_token(), spec.attn_out_dim
    mlp_w = max(spec.intermediate, spec.moe_intermediate * max(1, spec.experts_per_token))
    norm = c * d * (8 + (4 if e != 4 else 0))
    mask = chunk * wl.prompt_len * (1 + e) if wl.n_chunks > 1 else 0
    stages = [
        t * (d + whole * (q + kv)) * e + max(norm, c * (d + (1 + whole) * (q + kv) + 4 * q) * e),
        t * (d + q + kv) * e + c * o * e + wl.batch * spec.n_heads * chunk * 4 + mask,
        t * (d + o + whole * d) * e + c * d * e,
        t * (d + whole * d) * e + max(norm, c * (2 * d + 3 * mlp_w) * e),
        wl.batch * (d * (2 + 4 / e) + spec.vocab) * e + wl.batch * spec.vocab * 4,
    ]
    if spec.is_mla:  # absorbed attention: q in latent space, its rope part, and the latent output
        stages.append(t * (d + spec.n_heads * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim)) * e + mask)
    return (max(stages) + dequant_buffer_elems(spec) * DEQUANT_BYTES[device] + kv_read_bytes(spec, wl)
            + (upcast_bytes(spec, wl) if device == "cpu" else 0))


def upcast_bytes(spec: ModelSpec, wl: Workload) -> float:
    """What a prefill GEMM of 16-bit weights holds besides its output on a CPU without 16-bit
    GEMMs, multiplied in fp32 (``hetplan.runtime.kernels.linear.upcast_linear``), 4 bytes each:
    a block of x's rows (``upcast_rows``, at most its rows), one tile of
    ``DEQUANT_TILE_ELEMS`` weights (whole rows of the [N, K] weight, at most N) and their
    products; the most of any linear: the fused q/k/v, the output projection and the MLP's (gate
    and up fused, down) at a chunk's c rows, the head at one row per sequence. 0 for other
    weights. Reserved on every CPU (one with 16-bit GEMMs leaves it unused)."""
    if spec.weight_dtype not in ("bf16", "fp16"):
        return 0.0
    c, d, width = wl.batch * wl.chunk_len, spec.hidden, max(spec.intermediate, spec.moe_intermediate)
    linears = ((spec.q_dim + spec.kv_elems_per_token(), d, c), (d, spec.attn_out_dim, c), (2 * width, d, c),
               (d, width, c), (spec.vocab, d, wl.batch))
    most = 0
    for n, k, rows in linears:
        block = min(rows, upcast_rows(k))
        tile_rows = min(n, max(1, DEQUANT_TILE_ELEMS // k))
        most = max(most, block * k + tile_rows * k + block * tile_rows)
    return 4.0 * most


KV_READ_TOKENS = 256
"""Cache positions the runtime converts or dequantises at a time when it reads a KV cache that is
not a view in the compute dtype (``hetplan.runtime.kv_cache.READ_BLOCK_TOKENS``)."""
KV_PAD = {"q8_0": 32, "q4_0": 32, "q4_k_m": 256}
"""Values per quantisation block of the formats that pad a row to whole blocks."""


def kv_read_bytes(spec: ModelSpec, wl: Workload) -> float:
    """Bytes a decode attention holds while it reads one layer's KV cache block by block
    (a quantised cache, one in another dtype than the activations, or MLA's latent cache, whose
    latent and rope parts are scored apart): for the n = min(context, KV_READ_TOKENS) positions
    of one block, batch * n * (16 * padded K/V elements per token + 12 * heads) bytes, i.e. the
    block's values unpacked and scaled in fp32, copied to the compute dtype and viewed in fp32
    for the product (at most 16 bytes each, rows padded to whole quantisation blocks), and per
    query head three fp32 score rows (scores, exponentials, a rescaled sum). 0 when the cache is
    read as it lies (a plain cache in the activation dtype, standard attention)."""
    plain = spec.kv_dtype not in QUANTISED and bytes_per_element(spec.kv_dtype) == cost.activation_bytes_per_elem(spec)
    if plain and not spec.is_mla:
        return 0.0
    pad = KV_PAD.get(spec.kv_dtype, 1)
    elems = sum(-(-n // pad) * pad for n in spec.kv_rows())
    return wl.batch * min(wl.context_len, KV_READ_TOKENS) * (16 * elems + 12 * spec.n_heads)


def dequant_buffer_elems(spec: ModelSpec) -> int:
    """Elements of the buffer a quantised block's linears are dequantised into, on each device
    (0 for unquantised weights). Linears are multiplied from their packed bytes
    (``hetplan.runtime.kernels``), so only a linear a stage needs as a matrix has room here: MLA's
    absorbed ``kv_b`` (heads * (qk_nope + v_head) * kv_lora_rank elements). Prefill GEMMs also
    dequantise tiles of ``DEQUANT_TILE_ELEMS`` weights into cache, counted here too."""
    if spec.weight_dtype not in QUANTISED:
        return 0
    kv_b = spec.n_heads * (spec.qk_nope_head_dim + spec.v_head_dim) * spec.kv_lora_rank if spec.is_mla else 0
    return kv_b + DEQUANT_TILE_ELEMS


DEQUANT_TILE_ELEMS = 1 << 20
"""Weights one prefill GEMM tile dequantises at a time (``hetplan.runtime.kernels.linear.TILE_ELEMS``)."""


def upcast_rows(k: int, tile: int = DEQUANT_TILE_ELEMS) -> int:
    """Rows of x ``upcast_linear`` multiplies at a time for an input width ``k``: ``4 tile / k``,
    at least 64."""
    return max(64, 4 * tile // max(k, 1))
