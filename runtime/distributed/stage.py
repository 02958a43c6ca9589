"""One stage placed and ready to run: its blocks' weights and KV caches in their tiers, its
programs built, an executor over them; ``forward`` runs one phase for one step.

The same preparation as a single-GPU run (``hetplan.runtime.session.run_plan``: the checks, the
backend, ``Devices``, ``Residency``, ``build_program``, ``Executor``), for the part of the plan
this process runs (``part.stage_part``): it reads and places only its own blocks' weights. Knows
nothing about other processes.
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
from hetplan.runtime.executor import Executor
from hetplan.runtime.kernels import quant
from hetplan.runtime.residency import Residency, pinned_need_bytes
from hetplan.runtime.weights import torch_dtype


class StageRunner:
    """The part of a stage a process runs (``part.stage_part``), placed."""

    def __init__(self, part: Plan, source, mode: str, batch: int, name: str):
        """``source``: the weights (``weight_source``); ``mode``: ``cuda``, ``emulated`` or
        ``cpu`` (``session.choose_mode``); ``name``: how errors name the stage."""
        spec, wl = part.model, part.workload
        self.name, self.mode = name, mode
        quantised = quant.is_quantised(spec.weight_dtype)
        self.backend = backend = backend_for(spec)
        kinds = {t.kind for s in part.schedule.values() for t in s.tasks if t.kind not in TRANSFERS}
        if kinds - backend.kinds:
            raise HetplanError(f"{name}: stage kinds {sorted(kinds - backend.kinds)} have no implementation in "
                               f"the runtime's {spec.arch} backend")
        check_free_memory(part.memory, mode, torch.cuda.mem_get_info()[0] if mode == "cuda" else None,
                          host_available_bytes())
        if mode == "cuda":
            check_pinned_memory(pinned_need_bytes(part), host_available_bytes())
        dtype = quant.compute_dtype(mode) if quantised else torch_dtype(spec.weight_dtype, "--weight-dtype")
        if quantised:
            backend.dtype = dtype
        self.dtype = dtype
        self.devices = devices = Devices(mode, part.memory["gpu_budget_bytes"])
        for tier in ("cpu",) + (("gpu",) if mode != "cpu" else ()):
            backend.setup(devices.device(tier), wl.context_len)
        self.residency = Residency(part, backend, source, devices, dtype, kv_cache.storage(spec.kv_dtype), batch,
                                   wl.context_len)
        kv_names = tuple(backend.kv_shapes(1, 1))
        self.programs = {ph: build_program(ph, part.schedule[ph], backend.reads, backend.writes, kv_names)
                         for ph in ("prefill", "decode")}
        self.executor = Executor(self.programs, backend, self.residency, devices)
        self.chunk = wl.prefill_chunk or 0

    def forward(self, step: Step, inputs: dict) -> tuple[dict, float]:
        """Run ``step``'s phase on ``inputs`` (value name -> tensor, anywhere) -> (outputs where
        the stage left them, possibly in a buffer the next step reuses; seconds it was busy)."""
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
        self.executor.close()
        self.devices.close()
