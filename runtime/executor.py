"""The executor: interprets a phase's program, one queue per resource.

Each resource (``gpu``, ``cpu``, ``h2d``, ``d2h``, ``h2d_act``, ``d2h_act``) is a lane that runs
its tasks in the plan's order. A lane is served by a host thread: the calling thread serves the
``cpu`` lane (the ``gpu`` lane when a phase has no CPU task), persistent worker threads serve the
others with one intra-op thread each (they issue CUDA work or copy). The home lane's intra-op
threads are chosen for the lanes that run in the phase (``home_lane_threads``): all of them when
it runs alone, one core fewer when other lanes run beside it (their launches or, emulated, their
compute take about one core), so the lanes do not fight over the same cores.

- On a real GPU the CUDA lanes *issue* work on their own stream without blocking: a dependency on
  another stream is a ``wait_event`` on the producer's CUDA event, a dependency on the CPU lane
  waits for the CPU task to finish first. The CPU lane waits on a producer's CUDA event before it
  reads. A value crossing streams is recorded on the reader's stream before it is freed.
- Emulated (no GPU), every lane is a host thread computing or copying on the CPU, each copy into a
  storage of its own, so a wrong order or a reused staging slot shows up in the numbers.

Values live in a per-run store keyed (producer, name) and are dropped after their last reader;
on the emulated GPU their bytes count against its budget. Optionally every task's start and end
are measured (host clock; CUDA timing events on a GPU) for the trace.

Knows nothing about model math (the backend's) or where weights come from (the residency's).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from hetplan.runtime import kv_cache
from hetplan.runtime.backend import StageCall, Step
from hetplan.runtime.dataflow import INPUT, Program
from hetplan.runtime.devices import Devices


@dataclass(frozen=True)
class Timing:
    """One task as it ran: seconds since the start of its phase run."""
    index: int
    start_s: float
    end_s: float


class _Run:
    """The state of one phase run, shared by its lanes."""

    def __init__(self, program: Program, step: Step, devices: Devices, trace: bool):
        self.program, self.step, self.devices, self.trace = program, step, devices, trace
        self.done = [threading.Event() for _ in program.ops]
        self.store, self.bytes_of = {}, {}
        self.remaining = dict(program.readers)
        self.lock = threading.Lock()
        self.error = None
        self.timings = {}
        self.t0 = time.perf_counter()
        self.marks, self.marks_done = {}, 0
        """op index -> layer whose last stage it is, when progress is reported; layers done."""

    def put(self, key, tensor: torch.Tensor, device: str, what: str) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.devices.cuda or device == "cpu":
            self.devices.ledgers[device].reserve(nbytes, what)
            self.bytes_of[key] = (device, nbytes)
        self.store[key] = tensor

    def release(self, key) -> None:
        with self.lock:
            self.remaining[key] -= 1
            last = self.remaining[key] == 0
        if last:
            self.store.pop(key)
            if key in self.bytes_of:
                device, nbytes = self.bytes_of.pop(key)
                self.devices.ledgers[device].release(nbytes)

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        for e in self.done:
            e.set()

    def clear(self) -> None:
        for key, (device, nbytes) in self.bytes_of.items():
            self.devices.ledgers[device].release(nbytes)
        self.bytes_of.clear()
        self.store.clear()


def home_lane_threads(cores: int, lanes, home: str) -> int:
    """Intra-op threads for the home lane of a phase whose program has ``lanes``: every core when
    it runs alone; ``cores - 1`` (at least 1) when other lanes run beside it. The worker lanes
    each compute with one thread (an emulated GPU) or only launch and copy (a CUDA GPU), and
    share one interpreter lock: together about one core."""
    others = [lane for lane in lanes if lane != home]
    return max(1, cores - 1) if others else max(1, cores)


def _last_stage_of_each_layer(program: Program, blocks) -> dict:
    """op index -> layer, for the last compute op of every layer in ``program`` (the points a
    long prefill reports progress at)."""
    last = {}
    for op in program.ops:
        if op.task.kind not in ("act_up", "act_down", "load", "kv_down") and op.task.block in blocks:
            layer = blocks[op.task.block].layer
            if layer is not None:
                last[layer] = op.index
    return {i: key for key, i in last.items()}


class Executor:
    """Runs programs (one per phase) against placed weights and caches."""

    def __init__(self, programs: dict, backend, residency, devices: Devices, trace: bool = False,
                 progress=None, cores: int | None = None):
        """``progress(phase, done, total)``: called from the lanes as each layer's last stage of
        a prefill ends. ``cores``: the host cores the lanes share (default: torch's intra-op
        threads when the executor is made)."""
        self.programs, self.backend, self.residency, self.devices = programs, backend, residency, devices
        self.trace = trace
        self.progress = progress
        self._caller_threads = torch.get_num_threads()
        self.cores = cores or self._caller_threads
        self.layer_marks = {ph: _last_stage_of_each_layer(prog, residency.blocks) for ph, prog in programs.items()}
        self.weights = {ph: {op.index: residency.weights(op.task.block, op.device, op.task.slot)
                             for op in prog.ops if op.task.kind in backend.kinds}
                        for ph, prog in programs.items()}
        self.events = {}    # (phase, index) -> CUDA event marking the op's end on its stream
        self.timers = {}    # (phase, index) -> (start, end) CUDA timing events
        if devices.cuda:
            for ph, prog in programs.items():
                for op in prog.ops:
                    if devices.stream(op.task.resource) is not None:
                        self.events[ph, op.index] = torch.cuda.Event()
                        if trace:
                            self.timers[ph, op.index] = (torch.cuda.Event(enable_timing=True),
                                                         torch.cuda.Event(enable_timing=True))
        self.home = {ph: "cpu" if "cpu" in prog.lanes else "gpu" for ph, prog in programs.items()}
        self._threads = {}

    # -- one phase ---------------------------------------------------------------------------
    def run(self, phase: str, step: Step, inputs: dict) -> tuple[dict, list]:
        """Run ``phase`` for ``step`` with ``inputs`` (value name -> tensor on its device) ->
        (outputs on their devices, [Timing] when tracing)."""
        prog = self.programs[phase]
        run = _Run(prog, step, self.devices, self.trace)
        if self.progress and phase == "prefill":
            run.marks, run.marks_done = self.layer_marks[phase], 0
        for name, t in inputs.items():
            run.put((INPUT, name), t, prog.inputs[name], f"input {name}")
        if self.devices.cuda:  # inputs (and first-run weights) were copied on the default stream
            for lane in prog.lanes:
                if self.devices.stream(lane) is not None:
                    self.devices.stream(lane).wait_stream(torch.cuda.current_stream())
        t0_event = None
        if self.timers:
            t0_event = torch.cuda.Event(enable_timing=True)
            t0_event.record(self.devices.stream("gpu"))
        finished = []
        for lane in prog.lanes:
            if lane != self.home[phase]:
                ev = threading.Event()
                self._worker(lane).put((run, lane, ev))
                finished.append(ev)
        want = home_lane_threads(self.cores, prog.lanes, self.home[phase])
        if torch.get_num_threads() != want:  # the caller's count comes back on close()
            torch.set_num_threads(want)
        try:
            self._lane(run, self.home[phase])
            for ev in finished:
                ev.wait()
        except KeyboardInterrupt as e:  # the process is ending: stop the lanes, wait for none of them
            run.fail(e)
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the other lanes, re-raised below
            run.fail(e)
            for ev in finished:
                ev.wait()
        self.devices.synchronize()
        if run.error is not None:
            run.clear()
            raise run.error
        outputs = {name: run.store[key] for name, key in prog.outputs.items()}
        timings = self._timings(run, phase, t0_event) if self.trace else []
        run.clear()
        return outputs, timings

    def _lane(self, run: _Run, lane: str) -> None:
        prog, devices = run.program, self.devices
        stream = devices.stream(lane)
        phase = prog.phase
        for i in prog.lanes[lane]:
            op = prog.ops[i]
            for d in op.deps:
                run.done[d].wait()
                if run.error is not None:
                    return
                dep_lane = prog.ops[d].task.resource
                if devices.stream(dep_lane) is None or dep_lane == lane:
                    continue
                if stream is not None:
                    stream.wait_event(self.events[phase, d])
                else:
                    self.events[phase, d].synchronize()
            if stream is not None:
                with torch.cuda.stream(stream):
                    if self.timers:
                        self.timers[phase, i][0].record(stream)
                    self._execute(run, op, stream)
                    if self.timers:
                        self.timers[phase, i][1].record(stream)
                    self.events[phase, i].record(stream)
            else:
                start = time.perf_counter()
                self._execute(run, op, None)
                if run.trace:
                    run.timings[i] = (start - run.t0, time.perf_counter() - run.t0)
            run.done[i].set()
            if i in run.marks:
                self._report(run)

    def _execute(self, run: _Run, op, stream) -> None:
        task, prog = op.task, run.program
        inputs = {}
        for key in op.reads:
            t = run.store[key]
            if stream is not None and t.device.type == "cuda":
                t.record_stream(stream)
            inputs[key] = t
        kind = task.kind
        if kind in ("act_up", "act_down"):
            for (src, name) in op.reads:
                run.put((op.index, name), self.devices.to_tier(inputs[src, name], op.device, (prog.phase, op.index, name)),
                        op.device, f"{name} copied by {task.id}")
        elif kind == "load":
            self.residency.load(task.block, task.slot)
        elif kind == "kv_down":
            cache = self.residency.kv[task.block]
            for key in op.reads:   # quantised (if the cache is) before crossing, one copy per sequence
                kv_cache.write(cache[key[1]], run.step.start, inputs[key], non_blocking=self.devices.cuda)
        else:
            kv = None
            if kind in ("attn_core", "attn") and self.residency.kv_tier.get(task.block) == op.device:
                kv = self.residency.kv[task.block]
            weights = self.weights[prog.phase][op.index]
            if hasattr(weights, "materialise"):  # a quantised block: dequantised as the stage reads it
                weights = weights.materialise()
            call = StageCall(kind=kind, block=task.block, layer=self.residency.blocks[task.block].layer,
                             device=self.devices.device(op.device), weights=weights,
                             inputs={key[1]: t for key, t in inputs.items()}, step=run.step, kv=kv)
            for name, t in self.backend.run(call).items():
                run.put((op.index, name), t, op.device, f"{name} of {task.id}")
        del inputs
        for key in op.reads:
            run.release(key)

    def _report(self, run: _Run) -> None:
        with run.lock:
            run.marks_done += 1
            done = run.marks_done
        self.progress(run.program.phase, done, len(run.marks))

    def _timings(self, run: _Run, phase: str, t0_event) -> list:
        out = []
        for op in run.program.ops:
            if (phase, op.index) in self.timers:
                start, end = self.timers[phase, op.index]
                out.append(Timing(op.index, t0_event.elapsed_time(start) / 1e3, t0_event.elapsed_time(end) / 1e3))
            elif op.index in run.timings:
                out.append(Timing(op.index, *run.timings[op.index]))
        return out

    # -- worker threads ----------------------------------------------------------------------
    def _worker(self, lane: str) -> queue.SimpleQueue:
        if lane not in self._threads:
            jobs = queue.SimpleQueue()
            th = threading.Thread(target=self._serve, args=(jobs,), name=f"hetplan-{lane}", daemon=True)
            th.start()
            self._threads[lane] = (jobs, th)
        return self._threads[lane][0]

    @torch.inference_mode()
    def _serve(self, jobs: queue.SimpleQueue) -> None:
        torch.set_num_threads(1)  # this thread's own setting; the caller's stays as it was
        while True:
            job = jobs.get()
            if job is None:
                return
            run, lane, finished = job
            try:
                self._lane(run, lane)
            except BaseException as e:  # noqa: BLE001 - reported by the run's caller
                run.fail(e)
            finally:
                finished.set()

    def close(self, wait: bool = True) -> None:
        """End the worker threads; ``wait=False`` (Ctrl-C) does not wait for one that is in the
        middle of a task (they are daemon threads, and the process is ending)."""
        torch.set_num_threads(self._caller_threads)
        for jobs, th in self._threads.values():
            jobs.put(None)
            if wait:
                th.join()
        self._threads.clear()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(wait=exc_type is not KeyboardInterrupt)
