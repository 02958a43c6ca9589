"""Measure this machine with torch: the peaks behind node.yaml and the table behind node.profile.json.

Every measurement is timed the same way (``time_call``): two warm-up calls, a device
synchronisation after each call, repeats until the point's share of the budget is spent (at
least 3, at most 31), and the median and interquartile range recorded. The models' stages at one
row (a decode step of one sequence) are timed ``READINGS`` times at different moments, their
repeats pooled (a shared host's slow stretches). Measured:

- CPU: streaming-read memory bandwidth (a sum over a buffer 8x the last-level cache), the
  dispatch cost of one tiny op, GEMM peak per dtype (fp32, bf16, and fp16 where the CPU runs it
  at a usable rate), GEMV/GEMM over a standard grid of weight shapes (also with the weights in
  each quantised format, multiplied by the runtime's packed kernels), decode attention over a
  KV cache at several context lengths, causal prefill attention;
- GPU (when torch sees one): the same plus HBM bandwidth and kernel launch overhead;
- links (with a GPU): pinned and pageable host->device and device->host copies, 64 KiB-256 MiB;
- per ``--model``: every stage of the runtime's own backend for it (``hetplan.runtime.profiler.kernels``);
- the runtime's fixed cost per CPU task (a tiny plan executed with tracing, against the same
  stages called directly), which every measured point then includes: a point is a task's time.

The budget is a deadline: a measurement starts only when its estimated cost (from the peaks
measured first) fits in what is left of the budget and of its group's share; a second pass
spends what the first left over on the points that did not fit; what still did not is listed in
``skipped``. Knows nothing about solvers or files.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch

from hetplan.profile.table import Entry, Point, ProfileTable
from hetplan.runtime.profiler.machine import cache_bytes, load_average, machine_record
from hetplan.runtime.kernels.linear import linear
from hetplan.runtime.profiler.kernels import (QUANTISED, TORCH_DTYPES, attention_kernels, compute_dtype,
                                              linear_kernels, runtime_gemm, stage_kernels)

MIN_REPEATS, MAX_REPEATS = 3, 31
LINK_SIZES = tuple(1 << s for s in range(16, 29, 2))
"""Copy sizes of the link curves: 64 KiB, 256 KiB, ..., 256 MiB."""
READINGS = 3
"""How many times, at different moments, the points a decode step of one sequence is priced with
(each stage of the models at one row, ``one_row``) are timed: once in the pass over every kernel,
then again at its end with fresh operands while the budget allows. Their repeats are pooled, so a
stretch of slowness on a shared host that covers one kernel's points in one reading moves the
median only when it covers most readings. The other points are timed once."""
USABLE_FRACTION = 0.05
"""A 16-bit dtype whose GEMM rate is below this fraction of fp32's is emulated: not profiled."""


@dataclass(frozen=True)
class Timing:
    median_s: float
    spread_s: float
    """Interquartile range of the repeats."""
    repeats: int
    times: tuple = ()
    """Every repeat's seconds."""

    @staticmethod
    def of(times) -> "Timing":
        q = statistics.quantiles(times, n=4)
        return Timing(statistics.median(times), q[2] - q[0], len(times), tuple(times))


@dataclass
class Budget:
    """The profile's deadline, and what did not fit before it. ``left_s`` keeps back 5 % (at
    most 2 s) for checking and writing the results."""
    seconds: float
    start: float = field(default_factory=time.perf_counter)
    skipped: list = field(default_factory=list)

    def left_s(self) -> float:
        return self.seconds - min(2.0, 0.05 * self.seconds) - (time.perf_counter() - self.start)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def deadline(self) -> float:
        """``perf_counter`` value at which ``left_s`` reaches 0."""
        return time.perf_counter() + self.left_s()

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")


def time_call(fn, sync, share_s: float, deadline: float | None = None) -> Timing | None:
    """Time ``fn`` (two warm-up calls, then repeats until ``share_s`` is spent) -> median, IQR;
    None when ``deadline`` (a ``perf_counter`` value) comes before ``MIN_REPEATS`` repeats."""
    for _ in range(2):
        fn()
        sync()
    times = []
    while len(times) < MAX_REPEATS and (len(times) < MIN_REPEATS or sum(times) < share_s):
        if deadline is not None and time.perf_counter() > deadline:
            return None
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return Timing.of(times)


@dataclass(frozen=True)
class ProfileResult:
    peaks: dict
    """node.yaml path -> measured SI value (``cpu.mem_bandwidth``, ``links.h2d``, ``latency.cpu_task`` ...)."""
    machine: dict
    table: ProfileTable


def profile_machine(budget: Budget, specs: tuple = (), progress=None) -> ProfileResult:
    """Measure the CPU, the GPU if torch sees one, the links between them and each spec's stages
    before ``budget`` runs out. ``progress(n)`` returns a context manager whose
    ``update(1, current_item=label)`` is called once per step (a click progress bar)."""
    devices = ("cpu", "gpu") if torch.cuda.is_available() else ("cpu",)
    machine = machine_record(devices)
    load_before = load_average()
    peaks, entries, rates, usable, transfers = {}, {}, {}, {}, {}
    # The models' own stages first (they are what plans will price), then the standard grid.
    kernels = [k for device in devices for spec in specs for k in _model_kernels(spec, device, budget)]
    kernels += [k for device in devices for dtype in TORCH_DTYPES
                for k in linear_kernels(device, dtype) + attention_kernels(device, dtype)]
    kernels += [k for device in devices for dtype in QUANTISED for k in linear_kernels(device, dtype)]
    steps = len(devices) * (2 + len(TORCH_DTYPES)) + (4 if "gpu" in devices else 0) + 1 + len(kernels)
    with progress(steps) if progress else contextlib.nullcontext() as bar:
        def tick(label):
            if bar is not None:
                bar.update(1, current_item=label)

        for device in devices:
            usable[device] = _device_peaks(device, peaks, rates, budget, tick)
        if "gpu" in devices:
            transfers = _links(peaks, budget, tick)
        overhead = {"cpu": _cpu_task_overhead_s(budget), "gpu": 0.0}
        if overhead["cpu"]:
            peaks["latency.cpu_task"] = overhead["cpu"]
        tick("cpu task overhead in the runtime")
        emulated = [k for k in kernels if k.grid and compute_dtype(k.device, k.dtype) not in usable[k.device]]
        for k in emulated:  # standard-grid kernels of a dtype the device emulates (skip recorded)
            tick(_label(k))
        kernels = [k for k in kernels if k not in emulated]
        with torch.inference_mode():  # as the runtime executes stages
            # A second pass gives what the first left of the budget to the points that did
            # not fit in their group's share.
            raw = {}
            left_over = _run_kernels(kernels, rates, overhead, entries, budget, tick, final=False, raw=raw)
            _run_kernels(left_over, rates, overhead, entries, budget, tick, final=True, raw=raw)
            readings = _time_again([k for k in kernels if one_row(k)], raw, overhead, entries, budget)
    drift = _read_again(rates, budget)
    _grid_flops_peaks(entries, peaks)
    table = ProfileTable(entries={k: Entry(*k, tuple(sorted(v.values(), key=lambda p: p.x))) for k, v in entries.items()},
                         machine=machine, transfers=transfers,
                         info={"threads": torch.get_num_threads(), "torch": torch.__version__,
                               "budget_s": budget.seconds, "elapsed_s": round(budget.elapsed_s(), 3),
                               "skipped": list(budget.skipped), "peaks": dict(peaks),
                               "task_overhead_s": overhead, "load_average_before": load_before,
                               "cpu_read_end_bytes_per_s": drift, "one_row_readings": readings,
                               "models": [s.name for s in specs]})
    return ProfileResult(peaks=peaks, machine=machine, table=table)


# -- peaks --------------------------------------------------------------------------------------

def _sync(device: str):
    return torch.cuda.synchronize if device == "gpu" else (lambda: None)


def _device_peaks(device: str, peaks: dict, rates: dict, budget: Budget, tick) -> list:
    """Memory bandwidth, one op's dispatch cost and the GEMM peak per dtype (FLOP/s also into
    ``rates[device, dtype]``, for estimates); returns the dtypes the device runs natively.
    Each measurement gets 5 % of the budget (GEMMs shrink to fit it)."""
    dev, sync = ("cuda" if device == "gpu" else "cpu"), _sync(device)
    where = "gpus[0]" if device == "gpu" else "cpu"
    share = _peak_share(budget)
    nbytes = (1 << 30) if device == "gpu" else _cpu_read_bytes()
    peaks[f"{where}.mem_bandwidth"] = rates[device, "mem"] = nbytes / _read_s(nbytes, dev, sync, share)
    tick(f"{device} memory bandwidth")
    tiny = torch.ones(1, device=dev)
    if device == "gpu":
        n = 200
        t = time_call(lambda: [tiny.add_(1) for _ in range(n)], sync, share)
        peaks["latency.gpu_task"] = t.median_s / n
    else:
        peaks["latency.cpu_task"] = time_call(lambda: tiny.add_(1), sync, share).median_s
    tick(f"{device} op dispatch")
    usable, fp32_rate = [], None
    probe = 512 if budget.seconds >= 30 else 256
    for name, dt in TORCH_DTYPES.items():
        gemm = linear if runtime_gemm(device, name) else torch.matmul
        rate = _probe_rate(dt, dev, sync, probe, gemm)
        rates[device, name] = rate
        fp32_rate = fp32_rate or rate
        if rate < USABLE_FRACTION * fp32_rate:
            # The probe's rate is this dtype's peak here: without it node.yaml would lack the
            # dtype and the cost model would price it at the next one it finds (fp32).
            peaks[f"{where}.flops.{name}"] = rate
            budget.skip(f"{device} {name} GEMMs", f"matmul runs at {rate / 1e9:.2f} GFLOP/s here "
                        f"(emulated, < {USABLE_FRACTION:.0%} of fp32): standard grid not profiled")
            tick(f"{device} {name} GEMM")
            continue
        size = 8192 if device == "gpu" else 1024
        est = 2 * size ** 3 / rate * (2 + MIN_REPEATS)
        if est > budget.seconds * 0.05:
            size = max(probe, int(size * (budget.seconds * 0.05 / est) ** (1 / 3)) // 64 * 64)
        a, b = torch.ones(size, size, dtype=dt, device=dev), torch.ones(size, size, dtype=dt, device=dev)
        t = time_call(lambda: gemm(a, b), sync, share)
        peaks[f"{where}.flops.{name}"] = rates[device, name] = 2 * size ** 3 / t.median_s
        usable.append(name)
        tick(f"{device} {name} GEMM")
    return usable


def _peak_share(budget: Budget) -> float:
    """Seconds one peak measurement may take: 1 % of the budget, 0.01-0.5 s."""
    return max(0.01, min(0.5, budget.seconds * 0.01))


def _cpu_read_bytes() -> int:
    """The CPU's streaming-read buffer: 8x the last-level cache, 256 MiB-1 GiB."""
    return min(1 << 30, max(256 << 20, 8 * cache_bytes("cpu")))


def _read_s(nbytes: int, dev: str, sync, share_s: float) -> float:
    """Median time of one streaming read (a sum) over a buffer of ``nbytes``."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    return time_call(lambda: buf.sum(), sync, share_s).median_s


def _read_again(rates: dict, budget: Budget) -> float | None:
    """The CPU's streaming read measured again once every kernel is timed (None when the budget
    has no room left): against the first reading, how much the machine's speed moved while the
    profile ran (another tenant's load on a shared host moves both)."""
    if budget.left_s() < 1.0 or ("cpu", "mem") not in rates:
        return None
    nbytes = _cpu_read_bytes()
    return nbytes / _read_s(nbytes, "cpu", _sync("cpu"), _peak_share(budget))


def _probe_rate(dt, dev: str, sync, n: int, gemm) -> float:
    """FLOP/s of one n^3 GEMM (``gemm(a, b)``) after a small warm-up: enough to tell a native dtype
    from an emulated one (tens of times slower) without spending seconds on the latter."""
    a = torch.ones(n, n, dtype=dt, device=dev)
    gemm(a[:64, :64], a[:64, :64])
    sync()
    t0 = time.perf_counter()
    gemm(a, a)
    sync()
    return 2 * n ** 3 / (time.perf_counter() - t0)


def _links(peaks: dict, budget: Budget, tick) -> dict:
    """Copy curves h2d/d2h x pinned/pageable; links.* = pinned bandwidth at the largest size,
    latency.link_task = time of the smallest pinned copy beyond its bandwidth time."""
    curves = {}
    share = max(0.01, min(0.1, budget.left_s() * 0.005))
    for direction in ("h2d", "d2h"):
        for memory in ("pinned", "pageable"):
            pts = []
            for n in LINK_SIZES:
                est = n / 5e9 * (2 + MIN_REPEATS)
                if est > budget.left_s() * 0.05:
                    budget.skip(f"{direction} {memory} {n} B", "does not fit in the budget")
                    break
                host = torch.empty(n, dtype=torch.uint8, pin_memory=(memory == "pinned"))
                gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
                src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
                t = time_call(lambda: dst.copy_(src, non_blocking=memory == "pinned"), torch.cuda.synchronize, share)
                pts.append(Point(x=float(n), seconds=t.median_s, spread_s=t.spread_s, repeats=t.repeats,
                                 bytes=float(n)))
            curves[f"{direction}_{memory}"] = tuple(pts)
            tick(f"{direction} {memory} copies")
    for direction in ("h2d", "d2h"):
        pts = curves.get(f"{direction}_pinned")
        if pts:
            bw = pts[-1].x / pts[-1].seconds
            peaks[f"links.{direction}"] = bw
            if direction == "h2d":
                peaks["latency.link_task"] = max(pts[0].seconds - pts[0].x / bw, 1e-7)
    return curves


# -- kernels ------------------------------------------------------------------------------------

def _model_kernels(spec, device: str, budget: Budget) -> list:
    """The stages of ``spec`` in its own dtype (measured even where that dtype is slow: the
    runtime will run it so), or none, with the reason, when the runtime cannot execute them."""
    from hetplan.errors import HetplanError

    if spec.weight_dtype not in TORCH_DTYPES and spec.weight_dtype not in QUANTISED:
        budget.skip(f"{spec.name} on {device}", f"the runtime has no kernels for {spec.weight_dtype} weights")
        return []
    if spec.kv_dtype not in TORCH_DTYPES:
        budget.skip(f"{spec.name} on {device}", f"a {spec.kv_dtype} KV cache is not profiled")
        return []
    try:
        return stage_kernels(spec, device)
    except HetplanError as e:
        budget.skip(f"{spec.name} stages on {device}", str(e))
        return []


def one_row(k) -> bool:
    """Whether ``k`` is a point of a decode step of one sequence: a model's linear stage at one row."""
    return not k.grid and k.x == 1 and k.op in ("attn_in", "attn_out", "mlp", "moe", "head")


def _point(k, t: Timing, overhead: dict) -> Point:
    """``k`` timed as ``t``, as a task: the median call plus the runtime's per-task overhead."""
    return Point(x=float(k.x), seconds=t.median_s + overhead[k.device], spread_s=t.spread_s, repeats=t.repeats,
                 flops=k.work.flops, bytes=k.work.bytes)


def _time_again(ks: list, raw: dict, overhead: dict, entries: dict, budget: Budget) -> int:
    """Time the timed kernels of ``ks`` again (``READINGS - 1`` more times, a group's operands made
    afresh each time, as long as the budget allows a whole reading) and record each point over
    all its repeats -> how many readings every one of them had."""
    ks = [k for k in ks if (k.device, k.op, k.dtype, k.shape, k.x) in raw]
    if not ks:
        return 0
    done = 1
    for _ in range(READINGS - 1):
        first = {key: len(times) for key, times in raw.items()}
        share = min(0.3, budget.left_s() / (2 * len(ks) * (READINGS - 1)))
        if share < 0.02:
            break
        groups = {}
        for k in ks:
            groups.setdefault(k.group, []).append(k)
        complete = True
        for group in groups.values():
            cache = {}
            for k in group:
                t = time_call(k.setup(cache), _sync(k.device), share, budget.deadline())
                if t is None:
                    complete = False
                    break
                raw[(k.device, k.op, k.dtype, k.shape, k.x)].extend(t.times)
            cache.clear()
            if not complete:
                break
        if not complete:   # a reading that did not reach every point is dropped, so all have as many
            for key, n in first.items():
                del raw[key][n:]
            break
        done += 1
    for k in ks:
        entries[(k.device, k.op, k.dtype, k.shape)][k.x] = _point(k, Timing.of(raw[(k.device, k.op, k.dtype, k.shape, k.x)]),
                                                                  overhead)
    return done


def _run_kernels(kernels: list, rates: dict, overhead: dict, entries: dict, budget: Budget, tick,
                 final: bool, raw: dict | None = None) -> list:
    """Time every kernel whose estimate fits (each group gets an equal share of what is left)
    and record it as a task: its median call plus the runtime's per-task ``overhead[device]``.
    Returns the kernels that did not fit; on the ``final`` pass they are recorded as skipped.
    The repeats of the ``one_row`` kernels go into ``raw`` (key and x -> seconds)."""
    groups, left_over = {}, []
    for k in kernels:
        groups.setdefault(k.group, []).append(k)

    def give_up(k, why):
        if final:
            budget.skip(_label(k), why)
            tick(_label(k))
        else:
            left_over.append(k)

    for gi, ks in enumerate(groups.values()):
        group_end = time.perf_counter() + budget.left_s() / (len(groups) - gi)
        cache = {}
        ks = sorted(ks, key=lambda k: (k.work.flops, k.work.bytes))
        for i, k in enumerate(ks):
            est = _estimate_s(k, rates) * (2 + MIN_REPEATS) + (k.work.bytes / 1e9 if not cache else 0.0)
            group_left = group_end - time.perf_counter()
            if est > min(group_left, budget.left_s()):
                for rest in ks[i:]:
                    give_up(rest, f"estimated {est:.2f} s or more, does not fit in the budget")
                break
            fn = k.setup(cache)
            share = max(0.0, min(0.5, group_left / (len(ks) - i)))
            t = time_call(fn, _sync(k.device), share, budget.deadline())
            if t is None:
                give_up(k, "the budget ran out while timing it")
                continue
            entries.setdefault((k.device, k.op, k.dtype, k.shape), {})[k.x] = _point(k, t, overhead)
            if raw is not None and one_row(k):
                raw[(k.device, k.op, k.dtype, k.shape, k.x)] = list(t.times)
            tick(_label(k))
        cache.clear()
        if ks[0].device == "gpu":
            torch.cuda.empty_cache()
    return left_over


def _cpu_task_overhead_s(budget: Budget) -> float:
    """The runtime's fixed cost of one CPU task beyond its stage: a tiny all-CPU plan runs
    through the executor with tracing (``run_plan``), and each linear stage's median traced
    task time is compared with the same stage called directly; the median difference (0 when
    the budget cannot afford the run)."""
    from hetplan.evaluate import make_plan
    from hetplan.graph import block_graph
    from hetplan.hardware import load_node
    from hetplan.model import ModelSpec
    from hetplan.problem import price
    from hetplan.runtime.session import RunOptions, run_plan
    from hetplan.solvers.baselines import all_cpu
    from hetplan.plan.timeline import trace_pid
    from hetplan.workload import Workload

    if budget.left_s() < 2.0:
        budget.skip("runtime task overhead", "needs 2 s of budget; latency.cpu_task is one op's dispatch")
        return 0.0
    spec = ModelSpec(name="overhead-probe", arch="llama", n_layers=4, hidden=64, intermediate=128, n_heads=4,
                     n_kv_heads=2, head_dim=16, vocab=256, max_positions=256, weight_dtype="fp32", kv_dtype="fp32")
    problem = price(block_graph(spec, Workload(batch=1, prompt_len=4, gen_len=24)), load_node("cpu-64g"))
    plan = make_plan(problem, all_cpu(problem), {"strategy": "all-cpu", "status": "heuristic"})
    traced = {}
    for e in run_plan(plan, RunOptions(trace=True)).trace["traceEvents"]:
        if e.get("ph") == "X" and e["pid"] == trace_pid("measured", "decode"):
            traced.setdefault(e["cat"], []).append(e["dur"] * 1e-6)
    diffs = []
    with torch.inference_mode():
        for k in stage_kernels(spec, "cpu"):
            if k.x == 1 and k.op in traced:
                direct = time_call(k.setup({}), lambda: None, 0.02).median_s
                diffs.append(statistics.median(traced[k.op]) - direct)
    return max(statistics.median(diffs), 1e-7) if diffs else 0.0


def _label(k) -> str:
    return f"{k.device} {k.op} {k.shape} {k.dtype} x={k.x:g}"


def _estimate_s(k, rates: dict) -> float:
    """Roofline of the kernel on the rates measured so far, x2 for safety, + 0.1 ms."""
    flops = rates.get((k.device, compute_dtype(k.device, k.dtype))) or 1e9
    bw = rates.get((k.device, "mem")) or 1e9
    return 2 * max(k.work.flops / flops, k.work.bytes / bw) + 1e-4


def _grid_flops_peaks(entries: dict, peaks: dict) -> None:
    """A device's FLOP peak per dtype is the best rate any of its GEMMs reached."""
    for (device, op, dtype, _), pts in entries.items():
        if op != "linear" or dtype in QUANTISED:   # a packed kernel's rate is no arithmetic peak
            continue
        where = "gpus[0]" if device == "gpu" else "cpu"
        best = max(p.flops / p.seconds for p in pts.values())
        key = f"{where}.flops.{dtype}"
        peaks[key] = max(peaks.get(key, 0.0), best)

