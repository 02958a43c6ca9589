"""Run a plan end to end: check it, place the weights, prefill, decode, measure, compare.

``run_plan(plan, RunOptions(...))`` is what ``hetplan exec`` and the tests call. In order:
refuse what cannot run (a KV dtype it cannot store, stage kinds its backend lacks, a GPU plan
without a GPU unless emulated, more memory than is free now), then read the
prompt, place weights and KV caches (``Residency``), and run the prefill program once and the
decode program once per further token (``Executor``), sampling after each. A plan with quantised weights
(``hetplan.runtime.kernels.quant``) computes in bf16 on a CUDA GPU and in fp32 otherwise; a quantised KV
dtype stores caches packed per token row (``hetplan.runtime.kv_cache``). TTFT is prefill to the
first sampled token; TPOT the mean decode step; both sit next to the plan's predictions.

TTFT is measured warm: the first prefill (and one decode step) run untimed as a warm-up (cuBLAS
start-up, lazy module loading, first-touch of buffers), its time kept as ``cold_ttft_s``; the
timed prefill then rewrites the same cache positions with the same values. On an emulated GPU
the measured times are the CPU's, not the plan's GPU's: the run is marked not comparable and no
relative error is given.

Knows nothing about the command line; progress goes to an optional callback.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.routing import RoutingStats
from hetplan.runtime import kv_cache
from hetplan.runtime.kernels import quant
from hetplan.runtime.backend import Step, backend_for
from hetplan.runtime.dataflow import TRANSFERS, build_program
from hetplan.runtime.devices import Devices, check_free_memory, check_pinned_memory, host_available_bytes
from hetplan.runtime.executor import Executor
from hetplan.runtime.prompt import resolve_prompt, sample
from hetplan.runtime.residency import Residency, pinned_need_bytes
from hetplan.runtime.trace import load_bytes_per_s, measured_tasks, trace
from hetplan.runtime.weights import torch_dtype, weight_source

METRICS = ("ttft_s", "tpot_s", "decode_tokens_per_s")


@dataclass(frozen=True)
class RunOptions:
    weights: str = "random"
    """A checkpoint directory, or ``random``."""
    seed: int = 0
    """Seeds random weights, the default prompt and sampling."""
    prompt_ids: tuple | None = None
    """Token ids per sequence (one sequence is repeated over the plan's batch)."""
    prompt: str | None = None
    """Text, tokenised with the tokenizer beside the weights."""
    gen_len: int | None = None
    """Tokens to generate per sequence (default: the plan's); the first comes from prefill."""
    temperature: float = 0.0
    """0 = greedy; else sample from softmax(logits / temperature)."""
    emulate: bool | None = None
    """Run the GPU resource on the CPU; None = when torch sees no CUDA device."""
    trace: bool = False
    all_logits: bool = False
    """Prefill returns logits at every prompt position (kept in ``RunResult.logits``)."""
    keep_logits: bool = False
    """Keep every step's logits (on the CPU) in ``RunResult.logits``."""
    record_routing: bool = False
    """Count the experts every MoE layer chooses (``RunResult.routing``); MoE models only."""
    warmup: bool = True
    """Run the prefill (and one decode step) once untimed before the timed run; False: TTFT is
    the cold one."""


@dataclass(frozen=True)
class RunResult:
    tokens: list
    """Generated ids per sequence."""
    text: list | None
    mode: str
    """``cuda``, ``emulated`` or ``cpu``."""
    measured: dict
    predicted: dict
    relative_error: dict
    """(measured - predicted) / predicted per metric; None for every metric when not
    ``comparable``."""
    peak_bytes: dict
    """Tier -> measured peak bytes (the CUDA allocator's peak allocated bytes on a real GPU, and
    ``gpu_reserved``, its peak reserved bytes; counted placements and activations otherwise)."""
    planned_bytes: dict
    host_rss_bytes: int
    h2d_bytes_per_s: float | None = None
    """Achieved bandwidth of weight loads during decode (traced runs with streamed blocks)."""
    step_s: tuple = ()
    """Wall time of every decode step (TPOT is their mean)."""
    logits: list | None = field(default=None, repr=False)
    trace: dict | None = field(default=None, repr=False)
    routing: RoutingStats | None = field(default=None, repr=False)
    """Routing frequencies of every token the timed run put through the model (``record_routing``)."""
    pinned_bytes: int = 0
    """Host bytes actually page-locked for the GPU's copies (0 without a CUDA GPU)."""

    @property
    def comparable(self) -> bool:
        """Whether measured times can be held against the plan's: not on an emulated GPU."""
        return self.mode != "emulated"

    def to_json_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "mode": self.mode, "measured": self.measured,
                "predicted": self.predicted, "relative_error": self.relative_error,
                "comparable": self.comparable, "peak_bytes": self.peak_bytes, "planned_bytes": self.planned_bytes,
                "pinned_bytes": self.pinned_bytes, "host_rss_bytes": self.host_rss_bytes,
                "h2d_bytes_per_s": self.h2d_bytes_per_s}


def choose_mode(plan: Plan, emulate: bool | None) -> str:
    on_gpu = sum(t.resource != "cpu" for s in plan.schedule.values() for t in s.tasks)
    if not on_gpu:
        return "cpu"
    if emulate:
        return "emulated"
    if torch.cuda.is_available():
        return "cuda"
    if emulate is False:
        raise HetplanError(f"the plan runs {on_gpu} tasks on a GPU but torch sees no CUDA device here; "
                           f"pass --emulate to run it with the GPU emulated on the CPU")
    return "emulated"


def run_plan(plan: Plan, opts: RunOptions, progress=None) -> RunResult:
    spec, wl = plan.model, plan.workload
    quantised = quant.is_quantised(spec.weight_dtype)
    dtype = None if quantised else torch_dtype(spec.weight_dtype, "--weight-dtype")
    kv_dtype = kv_cache.storage(spec.kv_dtype)
    backend = backend_for(spec)
    kinds = {t.kind for s in plan.schedule.values() for t in s.tasks if t.kind not in TRANSFERS}
    if kinds - backend.kinds:
        raise HetplanError(f"plan for {spec.name!r}: stage kinds {sorted(kinds - backend.kinds)} have no "
                           f"implementation in the runtime's {spec.arch} backend")
    if opts.record_routing:
        if not spec.is_moe:
            raise HetplanError(f"--record-routing: model {spec.name!r} ({spec.arch}) has no experts; "
                               f"routing statistics exist only for mixture-of-experts models")
        from hetplan.runtime.models.moe.layer import RoutingRecorder
        backend.recorder = RoutingRecorder(spec)
    mode = choose_mode(plan, opts.emulate)
    free_gpu = torch.cuda.mem_get_info()[0] if mode == "cuda" else None
    check_free_memory(plan.memory, mode, free_gpu, host_available_bytes())
    if mode == "cuda":
        check_pinned_memory(pinned_need_bytes(plan), host_available_bytes())
    # A backend that brings its own weights (an ONNX graph's initializers) reads no checkpoint.
    source = backend.own_weights() if hasattr(backend, "own_weights") else weight_source(opts.weights, opts.seed, spec)
    ids, tokenizer = resolve_prompt(opts, source, spec, wl)
    gen_len = opts.gen_len or wl.gen_len
    needed = ids.shape[1] + gen_len - 1
    if gen_len < 1 or needed > wl.context_len:
        raise HetplanError(f"--gen-len {gen_len} with a {ids.shape[1]}-token prompt needs {needed} cached "
                           f"tokens, but the plan sized its KV cache for {wl.context_len} (prompt_len "
                           f"{wl.prompt_len} + gen_len {wl.gen_len}); recompile with a larger --gen-len")

    if quantised:  # weights stored packed, dequantised per stage into this dtype
        dtype = quant.compute_dtype(mode)
        backend.dtype = dtype
    devices = Devices(mode, plan.memory["gpu_budget_bytes"])
    for tier in ("cpu",) + (("gpu",) if mode != "cpu" else ()):
        backend.setup(devices.device(tier), wl.context_len)
    # Caches as large as the plan budgeted, whatever this run uses of them.
    residency = Residency(plan, backend, source, devices, dtype, kv_dtype, ids.shape[0], wl.context_len, progress)
    if hasattr(source, "close"):  # unmap a checkpoint: every tensor was copied out of it
        source.close()
    kv_names = tuple(backend.kv_shapes(1, 1))
    programs = {ph: build_program(ph, plan.schedule[ph], backend.reads, backend.writes, kv_names)
                for ph in ("prefill", "decode")}
    def after_warmup():  # the timed run's routing only
        if opts.record_routing:
            from hetplan.runtime.models.moe.layer import RoutingRecorder
            backend.recorder = RoutingRecorder(spec)

    interrupted = False
    try:
        with torch.inference_mode(), Executor(programs, backend, residency, devices, opts.trace,
                                              progress=progress) as ex:
            run = _generate(ex, programs, devices, ids, gen_len, opts, progress, after_warmup,
                            wl.prefill_chunk or 0)
    except KeyboardInterrupt:
        interrupted = True
        raise
    except torch.cuda.OutOfMemoryError:
        raise HetplanError(f"GPU memory budget exceeded: the run needed more than the plan's budget of "
                           f"{plan.memory['gpu_budget_bytes'] / 2**30:.2f} GiB (the allocator is capped at it); "
                           f"the plan does not fit the GPU it was compiled for: recompile it") from None
    finally:
        if not interrupted:  # Ctrl-C ends the process, and its exit releases the pinned buffers
            devices.close()

    batch = ids.shape[0]
    tpot_s = sum(run.step_s) / len(run.step_s) if run.step_s else None
    measured = {"ttft_s": run.ttft_s, "cold_ttft_s": run.cold_ttft_s, "tpot_s": tpot_s,
                "decode_tokens_per_s": batch / tpot_s if tpot_s else None}
    predicted = {k: plan.predicted[k] for k in METRICS}
    rel = {k: (measured[k] - predicted[k]) / predicted[k]
           if mode != "emulated" and measured[k] is not None and predicted[k] else None for k in METRICS}
    return RunResult(
        tokens=run.tokens, text=[tokenizer.decode(t) for t in run.tokens] if tokenizer else None, mode=mode,
        measured=measured, predicted=predicted, relative_error=rel, peak_bytes=devices.peak_bytes(),
        planned_bytes={"gpu": plan.memory["gpu_bytes"], "cpu": plan.memory["cpu_bytes"]},
        host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        h2d_bytes_per_s=load_bytes_per_s(run.tasks["decode"]) if opts.trace else None, step_s=tuple(run.step_s),
        logits=run.logits or None, trace=trace(plan, run.tasks) if opts.trace else None,
        routing=backend.recorder.stats() if opts.record_routing else None, pinned_bytes=devices.pinned_bytes)


@dataclass(frozen=True)
class _Generation:
    tokens: list
    ttft_s: float
    cold_ttft_s: float
    step_s: list
    logits: list
    tasks: dict
    """phase -> measured tasks (traced runs)."""


def _generate(ex: Executor, programs: dict, devices: Devices, ids: torch.Tensor, gen_len: int, opts: RunOptions,
              progress, after_warmup, chunk: int = 0) -> _Generation:
    """Warm up (``opts.warmup``: the prefill and one decode step, untimed, the prefill's time
    kept as the cold TTFT), then prefill (in chunks of ``chunk`` tokens, 0: at once), then one
    decode step per further token, sampling after each."""
    batch, prompt_len = ids.shape
    step_s, kept, tasks = [], [], {"prefill": [], "decode": []}

    def forward(phase, start, new_ids):
        dev = devices.device(programs[phase].inputs["ids"])
        step = Step(phase, start, new_ids.shape[1], batch, all_logits=opts.all_logits and phase == "prefill",
                    chunk=chunk if phase == "prefill" else 0)
        values, timings = ex.run(phase, step, {"ids": new_ids.to(dev)})
        return values["logits"].to(device="cpu", dtype=torch.float32, copy=True), timings

    def first_token(gen):
        t0 = time.perf_counter()
        logits, timings = forward("prefill", 0, ids)
        tok = sample(logits[:, -1] if logits.dim() == 3 else logits, opts.temperature, gen)
        return logits, timings, tok, time.perf_counter() - t0

    gen = torch.Generator().manual_seed(opts.seed)
    logits, timings, tok, cold_ttft_s = first_token(gen)
    ttft_s = cold_ttft_s
    if opts.warmup:
        if gen_len > 1:   # writes position prompt_len, which the timed first decode step rewrites
            forward("decode", prompt_len, tok[:, None])
        after_warmup()
        gen = torch.Generator().manual_seed(opts.seed)
        logits, timings, tok, ttft_s = first_token(gen)
    tasks["prefill"] = measured_tasks(programs["prefill"], timings, 0.0)
    tokens = [tok]
    if opts.keep_logits or opts.all_logits:
        kept.append(logits)
    decode_t0 = time.perf_counter()
    for i in range(gen_len - 1):
        if progress:
            progress("decode", i + 1, gen_len)
        s0 = time.perf_counter()
        logits, timings = forward("decode", prompt_len + i, tok[:, None])
        tok = sample(logits, opts.temperature, gen)
        step_s.append(time.perf_counter() - s0)
        tasks["decode"] += measured_tasks(programs["decode"], timings, s0 - decode_t0)
        tokens.append(tok)
        if opts.keep_logits:
            kept.append(logits)
    if progress:
        progress("decode", gen_len, gen_len)
    return _Generation(tokens=torch.stack(tokens, dim=1).tolist(), ttft_s=ttft_s, cold_ttft_s=cold_ttft_s,
                       step_s=step_s, logits=kept,
                       tasks=tasks)
