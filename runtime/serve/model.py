"""One batched forward over paged KV: every scheduled request's new tokens in one pass.

The weights of each block of the plan are placed in the tier the plan chose, as ``hetplan exec``
places them (``hetplan.runtime.residency``: a quantised plan's blocks packed, dequantised per
stage), and the dense backend's stages (``hetplan.runtime.models.dense``) compute on them.
A step's *segments* are (request, new token ids, first position). Token-wise stages (``attn_out``,
``mlp``) run once over every segment's tokens laid end to end ([1, N, D]);
``attn_in`` runs once over every segment's tokens (the rotary tables indexed by each token's own
position), ``embed`` and attention per segment, attention over the request's own
blocks gathered from the pool (causal from the segment's first position) on the device of the
tier they are in. With a GPU tier, a request decoding from DRAM has its attention computed on
the CPU lane, a worker thread, concurrently with the GPU lane's attention for the rest of the
batch: per layer, ``attn_in`` runs for every segment on the block's device, the DRAM segments'
q, k, v are copied down and handed to the CPU lane, the GPU segments' attention is issued on
the calling thread, and the two lanes' outputs are merged in segment order for ``attn_out``
(the CPU lane's copied up). ``head`` returns the
logits of each segment's last position.

Each block computes where the plan's exec for the step's phase says (a step is a ``prefill`` when
some segment brings more than one token, else a ``decode``): ``gpu`` on its resident weights,
``cpu`` on its host weights, ``stream`` on the GPU with its weights copied out of host memory
(pinned on a real GPU) into the staging slot the plan's ``load`` task names, ahead of use and
overlapped with the blocks before it (``hetplan.runtime.staging``: at most ``depth`` slots of the
largest streamed block, the plan's staging bytes). Knows nothing about scheduling or HTTP.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.runtime import kv_cache
from hetplan.runtime.backend import StageCall, Step, backend_for
from hetplan.runtime.kernels import quant
from hetplan.runtime.models.dense import DenseBackend, attention
from hetplan.runtime.residency import Residency
from hetplan.runtime.staging import StagingRing, streamed_slots
from hetplan.runtime.weights import TORCH_DTYPES

STAGES = {"embed": ("embed",), "attn": ("attn_in", "attn_core", "attn_out"), "mlp": ("mlp",), "head": ("head",)}


class PagedModel:
    def __init__(self, plan, source, devices, max_tokens: int):
        spec = plan.model
        quantised = quant.is_quantised(spec.weight_dtype)
        if not quantised and spec.weight_dtype not in TORCH_DTYPES:
            raise HetplanError(f"plan --weight-dtype {spec.weight_dtype}: hetplan serve runs weights in "
                               f"{', '.join(TORCH_DTYPES)} or a quantised format; recompile the plan with one of them")
        self.backend = backend_for(spec)
        if not isinstance(self.backend, DenseBackend):
            raise HetplanError(f"model family {spec.arch!r}: hetplan serve runs the dense families "
                               f"(llama, mistral, qwen2, qwen3, opt, gpt2)")
        self.plan, self.spec, self.devices = plan, spec, devices
        # quantised weights stay packed and are dequantised per stage into the compute dtype
        self.dtype = quant.compute_dtype(devices.mode) if quantised else TORCH_DTYPES[spec.weight_dtype]
        if quantised:
            self.backend.dtype = self.dtype
        for tier in ("gpu", "cpu") if devices.mode != "cpu" else ("cpu",):
            self.backend.setup(devices.device(tier), max_tokens)
        # every block's weights in its tier, as ``hetplan exec`` places them; the caches it would
        # hold are one position each (the paged pool holds the serving caches)
        self.residency = Residency(plan, self.backend, source, devices, self.dtype,
                                   kv_cache.storage(spec.kv_dtype), 1, 1)
        self.blocks = [(p["block"], p["kind"], p["layer"]) for p in sorted(plan.placement, key=_order)]
        self.has_head = any(kind == "head" for _, kind, _ in self.blocks)
        self.where = {phase: _where(plan, phase, devices.mode) for phase in PHASES}
        """phase -> block -> (tier it computes on, staging slot or None)."""
        self.weights = {phase: {name: self.residency.weights(name, tier, slot) for name, (tier, slot) in w.items()}
                        for phase, w in self.where.items()}
        """phase -> block -> the tensors its stages compute with (a slot's views for a streamed block)."""
        self.streamed = {phase: [(name, w[name][1]) for name, _, _ in self.blocks if w[name][1] is not None]
                         for phase, w in self.where.items()}
        self.ring = StagingRing(self.residency, devices) if any(self.streamed.values()) else None
        # attention layer -> its index in the pool's layer axis
        self.kv_index = {layer: j for j, layer in enumerate(l for _, k, l in self.blocks if k == "attn")}
        self.scale = 1.0 if self.backend.q_scale is not None else None
        self.cpu_lane = (ThreadPoolExecutor(1, thread_name_prefix="hetplan-serve-cpu-attention")
                         if devices.mode != "cpu" else None)
        """The worker thread DRAM requests' attention runs on (None without a GPU tier: then every
        request's cache is in host memory and attention runs on the calling thread)."""

    def forward(self, pool, segments: list, x: torch.Tensor | None = None) -> torch.Tensor:
        """segments: [(rid, ids [n] list, start)] -> fp32 logits [len(segments), V] at each
        segment's last position; writes every segment's K/V into ``pool``. A pipeline stage's part
        (``hetplan.runtime.distributed.part``) without the embedding starts from ``x``, the hidden
        state [1, N, D] of every segment's tokens laid end to end, and one without the head
        returns its hidden state [1, N, D] instead of logits."""
        lengths = [len(ids) for _, ids, _ in segments]
        offsets = [sum(lengths[:i]) for i in range(len(segments))]
        phase = "prefill" if any(n > 1 for n in lengths) else "decode"
        if self.ring is not None:
            self.ring.start(self.streamed[phase])
        for name, kind, layer in self.blocks:
            tier, slot = self.where[phase][name]
            dev, w = self.devices.device(tier), self.weights[phase][name]
            if slot is not None:
                self.ring.ready(name)
            if kind == "embed":
                parts = [self._run("embed", name, layer, dev, w, {"ids": torch.tensor([ids], device=dev)}, start, len(ids))
                         ["x"] for _, ids, start in segments]
                x = torch.cat(parts, dim=1)                    # [1, N, D]
            elif kind == "attn":
                x = x.to(dev)
                o = self._attention_layer(pool, name, layer, dev, w, x, segments, offsets, lengths)
                x = self._run("attn_out", name, layer, dev, w, {"x": x, "o": o}, 0, x.shape[1])["x"]
            elif kind == "mlp":
                x = self._run("mlp", name, layer, dev, w, {"x": x.to(dev)}, 0, x.shape[1])["x"]
            else:
                last = torch.tensor([off + n - 1 for off, n in zip(offsets, lengths)], device=dev)
                h = x.to(dev).index_select(1, last)            # [1, S, D]
                logits = self._run("head", name, layer, dev, w, {"x": h}, 0, h.shape[1], all_logits=True)["logits"]
            if slot is not None:
                self.ring.release(name)
        if not self.has_head:
            return x                                           # [1, N, D]
        return logits[0].float().cpu()                         # [S, V]

    def _attention_layer(self, pool, name, layer, dev, w, x, segments, offsets, lengths) -> torch.Tensor:
        """Every segment's attention output of one layer, [1, N, H*hd] on ``dev``: the DRAM
        segments' on the CPU lane while the others' are issued here (see the module doc)."""
        j = self.kv_index[layer]
        positions = torch.cat([torch.arange(start, start + n) for (_, _, start), n in zip(segments, lengths)])
        with self._rotary_at(dev, positions):  # one attn_in over every segment's tokens
            qkv = self._run("attn_in", name, layer, dev, w, {"x": x}, 0, x.shape[1])
        work = []  # (rid, start, q [1, n, H, hd], k, v [n, KVH, hd]) on the device of the request's cache
        for (rid, _, start), off, n in zip(segments, offsets, lengths):
            kv_dev = pool.device(pool.alloc.table(rid).tier)
            q, k, v = (qkv[t][:, off:off + n].to(kv_dev) for t in ("q", "k", "v"))
            work.append((rid, start, q, k[0], v[0]))
        in_dram = [pool.alloc.table(rid).tier == "cpu" for rid, *_ in work] if self.cpu_lane else [False] * len(work)
        lane = None
        if any(in_dram):
            dram = [item for item, d in zip(work, in_dram) if d]
            lane = self.cpu_lane.submit(_in_inference_mode, self._attend_all, pool, j, dram)
        here = iter(self._attend_all(pool, j, [item for item, d in zip(work, in_dram) if not d]))
        there = iter(lane.result() if lane is not None else ())
        outs = [next(there).to(dev) if d else next(here) for d in in_dram]
        return torch.cat(outs, dim=1)                          # [1, N, H*hd]

    @contextmanager
    def _rotary_at(self, dev, positions: torch.Tensor):
        """Within it, the backend's rotary tables on ``dev`` hold the rows of ``positions`` [N]
        (each token's own position), so that one ``attn_in`` from start 0 over N tokens rotates
        token i exactly as a call at its own position would."""
        tables = getattr(self.backend, "_tables", {})
        if dev not in tables:  # no rotary embedding (learned positions are added in embed)
            yield
            return
        cos, sin = tables[dev]
        idx = positions.to(cos.device)
        tables[dev] = (cos.index_select(0, idx), sin.index_select(0, idx))
        try:
            yield
        finally:
            tables[dev] = (cos, sin)

    def _attend_all(self, pool, j: int, work: list) -> list:
        """Attention of each (rid, start, q [1, n, H*hd], k, v [n, KVH, hd]) over its cache,
        after storing its new k, v there: -> [1, n, H*hd] each, on the cache's device. As in
        ``hetplan exec``, a prompt's first chunk (start 0) attends over its own k, v as computed,
        a later one over the cache as stored (quantised, in a quantised KV dtype)."""
        outs = []
        for rid, start, q, k_new, v_new in work:
            n = q.shape[1]
            pool.write(rid, j, start, k_new, v_new)
            if start == 0:
                k, v = k_new[None], v_new[None]                # [1, n, KVH, hd]
            else:
                k, v = pool.gather(rid, j, start + n)          # [1, T, KVH, hd]
            outs.append(attention(q, k.to(q.dtype), v.to(q.dtype), start, scale=self.scale))
        return outs

    def close(self) -> None:
        """Stop the CPU lane's and the copy lane's threads."""
        if self.cpu_lane is not None:
            self.cpu_lane.shutdown(wait=True)
        if self.ring is not None:
            self.ring.close()

    def _run(self, kind, name, layer, dev, w, inputs, start, n, all_logits=False):
        step = Step("prefill" if n > 1 else "decode", start, n, 1, all_logits=all_logits)
        if hasattr(w, "materialise"):  # a quantised block: dequantised as the stage reads it
            w = w.materialise()
        return self.backend.run(StageCall(kind, name, layer, dev, w, inputs, step))


def _in_inference_mode(fn, *args):
    """``fn(*args)`` under ``torch.inference_mode`` (a mode is per thread: the CPU lane's own)."""
    with torch.inference_mode():
        return fn(*args)


def _where(plan, phase: str, mode: str) -> dict:
    """block -> (tier its stages compute on in ``phase``, staging slot or None): as the plan's exec
    says (``stream``: the GPU, from the slot of the block's ``load``), or the CPU without a GPU."""
    slots = streamed_slots(plan, phase)
    out = {}
    for p in plan.placement:
        ex = p["exec"][phase] if mode != "cpu" else "cpu"
        if ex == "stream" and p["block"] not in slots:
            raise HetplanError(f"plan placement of block {p['block']}: streamed in {phase}, but the {phase} "
                               f"schedule has no load for it; recompile the plan with `hetplan compile`")
        out[p["block"]] = ("gpu", slots[p["block"]]) if ex == "stream" else (ex, None)
    return out


def _order(p: dict) -> tuple:
    rank = {"embed": 0, "attn": 1, "mlp": 2, "head": 3}[p["kind"]]
    return (-1 if p["kind"] == "embed" else (10**9 if p["kind"] == "head" else p["layer"]), rank)
