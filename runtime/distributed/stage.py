"""One stage placed and ready to run: its blocks' weights and KV caches in their tiers, its
programs built, an executor over them; ``forward`` runs one phase for one step.

The same preparation as a single-GPU run (``hetplan.runtime.session.run_plan``: the checks, the
backend, ``Devices``, ``Residency``, ``build_program``, ``Executor``), for the part of the plan
this process runs (``part.stage_part``): it reads and places only its own blocks' weights.

Micro-batches: the stage holds one KV cache per micro-batch (the first is the residency's own,
the others allocated beside it in the same tiers, counted by the same ledgers) and one copy of
the weights; ``forward`` runs a pass over the caches of the micro-batch it names. The stage's
plan sized its caches for the plan's micro-batches (``pipeline.micro_batches``: its placement's
``kv_bytes`` are that many caches); more micro-batches than that take more memory than the plan
placed (``extra_kv_bytes``), which the node check (``node.check_micro_batches``) refuses when it
does not fit. Knows nothing about other processes.
"""

from __future__ import annotations

import time

import torch

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.runtime import kv_cache
from hetplan.runtime.backend import Step, backend_for
from hetplan.runtime.dataflow import TRANSFERS, build_program
from hetplan.runtime.devices import Devices, check_free_memory, check_pinned_memory, host_available_bytes
from hetplan.runtime.distributed.node import extra_kv_bytes
from hetplan.runtime.executor import Executor
from hetplan.runtime.kernels import quant
from hetplan.runtime.residency import Residency, pinned_need_bytes
from hetplan.runtime.weights import torch_dtype


class StageRunner:
    """The part of a stage a process runs (``part.stage_part``), placed."""

    def __init__(self, part: Plan, source, mode: str, batch: int, name: str, micro_batches: int = 1,
                 planned: int = 1):
        """``source``: the weights (``weight_source``); ``mode``: ``cuda``, ``emulated`` or
        ``cpu`` (``session.choose_mode``); ``name``: how errors name the stage; ``batch``: the
        sequences of one micro-batch, of which ``micro_batches`` take turns; ``planned``: the
        micro-batches the plan's KV bytes are for."""
        spec, wl = part.model, part.workload
        self.name, self.mode = name, mode
        quantised = quant.is_quantised(spec.weight_dtype)
        self.backend = backend = backend_for(spec)
        kinds = {t.kind for s in part.schedule.values() for t in s.tasks if t.kind not in TRANSFERS}
        if kinds - backend.kinds:
            raise HetplanError(f"{name}: stage kinds {sorted(kinds - backend.kinds)} have no implementation in "
                               f"the runtime's {spec.arch} backend")
        extra = extra_kv_bytes(part, micro_batches, planned)
        check_free_memory(with_extra_kv(part.memory, extra), mode,
                          torch.cuda.mem_get_info()[0] if mode == "cuda" else None, host_available_bytes())
        if mode == "cuda":   # the further micro-batches' host caches that the GPU copies into are pinned too
            kv_down = {t.block for t in part.schedule["prefill"].tasks if t.kind == "kv_down"}
            more = max(0, micro_batches - planned) * sum(int(p["kv_bytes"]) // planned for p in part.placement
                                                         if p["block"] in kv_down)
            check_pinned_memory(pinned_need_bytes(part) + more, host_available_bytes())
        dtype = quant.compute_dtype(mode) if quantised else torch_dtype(spec.weight_dtype, "--weight-dtype")
        if quantised:
            backend.dtype = dtype
        self.dtype = dtype
        self.devices = devices = Devices(mode, part.memory["gpu_budget_bytes"])
        for tier in ("cpu",) + (("gpu",) if mode != "cpu" else ()):
            backend.setup(devices.device(tier), wl.context_len)
        kv_dtype = kv_cache.storage(spec.kv_dtype)
        self.residency = Residency(part, backend, source, devices, dtype, kv_dtype, batch,
                                   wl.context_len)
        self.kv_sets = [self.residency.kv] + [
            self._more_kv(part, backend.kv_shapes(batch, wl.context_len), kv_dtype, i)
            for i in range(1, micro_batches)]
        """Per micro-batch: attention block -> its cache values (``Residency.kv``'s layout)."""
        self.planned_bytes = {t: part.memory[f"{t}_bytes"] + extra[t] for t in ("gpu", "cpu")}
        """Bytes the plan places in each tier, with the further micro-batches' KV caches."""
        kv_names = tuple(backend.kv_shapes(1, 1))
        self.programs = {ph: build_program(ph, part.schedule[ph], backend.reads, backend.writes, kv_names)
                         for ph in ("prefill", "decode")}
        self.executor = Executor(self.programs, backend, self.residency, devices)
        self.chunk = wl.prefill_chunk or 0

    def _more_kv(self, part: Plan, shapes: dict, kv_dtype, micro: int) -> dict:
        """Another micro-batch's caches, where and as the residency holds the first's."""
        kv_down = {t.block for t in part.schedule["prefill"].tasks if t.kind == "kv_down"}
        return {p["block"]: {name: kv_cache.allocate(self.devices, p["kv"], shape, kv_dtype,
                                                     f"KV cache {name} of {p['block']} (micro-batch {micro})",
                                                     pinned=p["block"] in kv_down)
                             for name, shape in shapes.items()}
                for p in part.placement if p["kv"] is not None}

    def forward(self, step: Step, inputs: dict, micro: int = 0) -> tuple[dict, float]:
        """Run ``step``'s phase of micro-batch ``micro`` (over its KV caches) on ``inputs``
        (value name -> tensor, anywhere) -> (outputs where the stage left them, possibly in a
        buffer the next step reuses; seconds it was busy)."""
        self.residency.kv = self.kv_sets[micro]
        prog = self.programs[step.phase]
        given = {n: t.to(self.devices.device(prog.inputs[n])) for n, t in inputs.items()}
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                values, _ = self.executor.run(step.phase, step, given)
        except torch.cuda.OutOfMemoryError:
            raise HetplanError(f"{self.name}: GPU memory budget exceeded: the run needed more than the plan's "
                               f"budget; the plan does not fit the GPU it was compiled for: recompile it") from None
        self.devices.synchronize()
        busy = time.perf_counter() - t0
        return values, busy

    def step(self, phase: str, start: int, new_tokens: int, batch: int, all_logits: bool = False) -> Step:
        return Step(phase, start, new_tokens, batch, all_logits=all_logits and phase == "prefill",
                    chunk=self.chunk if phase == "prefill" else 0)

    def close(self) -> None:
        self.kv_sets = []
        self.executor.close()
        self.devices.close()


def with_extra_kv(memory: dict, extra: dict) -> dict:
    return dict(memory, gpu_bytes=memory["gpu_bytes"] + extra["gpu"], cpu_bytes=memory["cpu_bytes"] + extra["cpu"])
