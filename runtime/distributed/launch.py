"""Start a pipeline run: one process per stage, here (spawned) or under torchrun (this process
is one of them), and what each says when it cannot go on.

A plan with ``R`` replicas (``pipeline.replicas``) of a pipeline of ``S`` stages runs as ``R x S``
processes, replica ``r``'s stage ``s`` being rank ``r x S + s`` (``ranks.Ranks``); ``R = 1``
without replicas.

- Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set): this
  process is rank ``RANK``; ``WORLD_SIZE`` must be ``R x S`` (one process per stage of every
  replica over every node: ``--nnodes N --nproc-per-node`` adding up to it). Rendezvous
  ``env://``.
- Otherwise, with several processes: ``torch.multiprocessing`` spawns them with a rendezvous at
  ``tcp://127.0.0.1:PORT`` (a free port) and watches them, once every stage is known to fit
  this machine at the micro-batches asked for. The last rank hands the result back through a
  queue. When one process fails, the others stop on their own (their messages to it fail at
  once when its connections close, or after ``timeout_s``; the other replicas' at their next
  heartbeat, ``peers``); any still running ``GRACE_S`` seconds later are ended.
- One process: it runs in this process, without a process group.

Every process first checks that this machine can hold its stage (``node.check_node``: a GPU
as large as the plan's, enough host memory, room for the micro-batches' KV caches; a GPU of
another name is a warning line), then places its stage, then the processes tell each other
whether they are ready (``all_gather_object``), so a stage that cannot start (a GPU this machine
lacks or too small, not enough memory) stops every process at once, each with one line naming
its stage. ``micro_batches`` groups of the plan's batch flow through each replica's stages
(``flow``; default ``worker.default_micro_batches``). The rendezvous and every message wait at
most ``timeout_s`` (``--dist-timeout``). Intra-op threads are shared out: ``cores // processes``
per spawned process. ``hetplan serve``'s pipeline (``hetplan.runtime.serve.pipeline.launch``)
starts its processes with the same pieces (``ready``, ``as_process``, the torchrun variables).
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import sys
import time

import torch

from hetplan.errors import HetplanError
from hetplan.pipeline.record import stage_plan
from hetplan.plan import Plan
from hetplan.runtime.distributed.node import check_micro_batches, check_node
from hetplan.runtime.distributed.peers import Peers, join, leave
from hetplan.runtime.distributed.ranks import Ranks
from hetplan.runtime.distributed.worker import (PipelineResult, PreparedStage, default_micro_batches,
                                                planned_micro_batches, stage_device)
from hetplan.runtime.session import RunOptions, choose_mode

DEFAULT_TIMEOUT_S = 300.0
"""Default wait for the rendezvous and for any one message (``--dist-timeout``)."""
MAX_MICRO_BATCHES = 4096
"""The most micro-batches a run takes (``--micro-batches``)."""
GRACE_S = 10.0
"""How long the local launcher lets the other processes stop on their own after one failed."""
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return all(v in environ for v in TORCHRUN_VARS)


def run_pipeline(plan: Plan, opts: RunOptions, timeout_s: float = DEFAULT_TIMEOUT_S,
                 progress=None, micro_batches: int | None = None) -> PipelineResult | None:
    """Run ``plan``'s pipeline with ``micro_batches`` groups of its batch (None: the plan's
    default) -> its result (None in a torchrun process other than the last rank's)."""
    ranks = Ranks.of(plan.pipeline)
    world = ranks.world
    m = default_micro_batches(plan) if micro_batches is None else micro_batches
    if not 1 <= m <= MAX_MICRO_BATCHES:
        raise HetplanError(f"--micro-batches {m}: must be 1 to {MAX_MICRO_BATCHES}")
    if under_torchrun():
        rank, size = env_int("RANK"), env_int("WORLD_SIZE")
        if size != world or not 0 <= rank < world:
            of = (f"{ranks.replicas} replicas x {ranks.stages} stage(s) = {world} processes"
                  if ranks.replicas > 1 else f"{world} stage(s), one process each")
            raise HetplanError(f"WORLD_SIZE {size}, RANK {rank}: the plan's pipeline runs {of}; start {world} "
                               f"processes in all (torchrun --nnodes and --nproc-per-node adding up to {world})")
        return run_rank(plan, rank, "env://", opts, timeout_s, progress, m)
    if world == 1:
        mode, gpu = checked_device(plan, 0, opts, m)
        if mode == "cuda":
            torch.cuda.set_device(gpu)
        return PreparedStage(plan, 0, opts, mode, m).run(None, progress)
    for rank in range(world):  # this machine runs every process: refuse one it cannot before starting any
        mode, _ = stage_device(plan, rank, opts.emulate)
        s = ranks.split(rank)[1]
        check_micro_batches(stage_plan(plan, s), ranks.name(rank), mode, m, planned_micro_batches(plan))
    return _spawn(plan, opts, timeout_s, progress, m)


def checked_device(plan: Plan, rank: int, opts: RunOptions, micro_batches: int) -> tuple[str, int]:
    """(mode, GPU) of process ``rank`` here, once this machine is known to hold its stage with
    ``micro_batches``; says each warning on its own line."""
    ranks = Ranks.of(plan.pipeline)
    mode, gpu = stage_device(plan, rank, opts.emulate)
    s = ranks.split(rank)[1]
    for line in check_node(stage_plan(plan, s), s, mode, gpu, micro_batches, planned_micro_batches(plan),
                           ranks.name(rank)):
        say(line, "warning")
    return mode, gpu


def env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise HetplanError(f"environment variable {name}={os.environ[name]!r}: not an integer (set by torchrun; "
                           f"start the run with torchrun, or unset the torchrun variables)") from None


def message_backend(plan: Plan, emulate: bool | None) -> str:
    """``nccl`` when every stage runs on a CUDA GPU here, else ``gloo``."""
    modes = {choose_mode(stage_plan(plan, s), emulate) for s in range(len(plan.pipeline["stages"]))}
    return "nccl" if modes == {"cuda"} else "gloo"


def run_rank(plan: Plan, rank: int, init_method: str, opts: RunOptions, timeout_s: float,
             progress=None, micro_batches: int = 1) -> PipelineResult | None:
    """Be process ``rank`` (a replica's stage): check this machine, rendezvous, place the stage,
    agree that every process is ready, run."""
    return named(Ranks.of(plan.pipeline).name(rank), _be_rank, plan, rank, init_method, opts, timeout_s, progress,
                 micro_batches)


def named(name: str, fn, *args):
    """``fn(*args)``, its one-line errors naming the process (``stage 1``, ``replica 0 stage 1``):
    every line a stage process says names its stage."""
    try:
        return fn(*args)
    except HetplanError as e:
        if str(e).startswith(f"{name}:"):
            raise
        raise HetplanError(f"{name}: {e}") from None


def _be_rank(plan: Plan, rank: int, init_method: str, opts: RunOptions, timeout_s: float, progress,
             micro_batches: int):
    prepared, peers = ready(plan, rank, init_method, opts, timeout_s, micro_batches,
                            lambda mode: PreparedStage(plan, rank, opts, mode, micro_batches))
    try:
        return prepared.run(peers, progress)
    finally:
        leave()


def ready(plan: Plan, rank: int, init_method: str, opts: RunOptions, timeout_s: float, micro_batches: int,
          prepare) -> tuple:
    """Be process ``rank`` up to the point every process is ready: check this machine, rendezvous,
    ``prepare(mode)`` (place the stage: -> an object with ``close``), agree that every process
    is ready -> (prepared, ``Peers``). The caller ``leave``s the process group when done; on a
    HetplanError (this process's or another's), it has been left."""
    ranks = Ranks.of(plan.pipeline)
    world, name = ranks.world, ranks.name(rank)
    backend = message_backend(plan, opts.emulate)
    prepared, problem, mode = None, None, None
    try:   # said to the others once the rendezvous is done, so that every process stops at once
        mode, gpu = checked_device(plan, rank, opts, micro_batches)
        if mode == "cuda":
            torch.cuda.set_device(gpu)   # before the rendezvous: NCCL's communicators use it
    except HetplanError as e:
        problem = str(e)
    join(rank, world, backend, init_method, timeout_s, name)
    try:
        if problem is None:
            try:
                prepared = prepare(mode)
            except HetplanError as e:
                problem = str(e)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        peers = Peers(ranks, rank, device, timeout_s)
        answers = peers.all_gather(problem)
        if problem is not None:
            raise HetplanError(problem)
        others = [(ranks.name(r), p) for r, p in enumerate(answers) if p is not None]
        if others:
            prepared.close()
            them, p = others[0]
            raise HetplanError(f"{name}: not started: {them} cannot run ({p.removeprefix(f'{them}: ')})")
        return prepared, peers
    except BaseException:
        leave()
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(plan: Plan, opts: RunOptions, timeout_s: float, progress, micro_batches: int) -> PipelineResult:
    import torch.multiprocessing as mp

    ranks = Ranks.of(plan.pipeline)
    world = ranks.world
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = [ctx.Process(target=_child, name=f"hetplan-{ranks.name(r).replace(' ', '-')}", daemon=False,
                         args=(plan, r, init, opts, timeout_s, progress if r == ranks.reporter else None, threads,
                               results, micro_batches))
             for r in range(world)]
    for p in procs:
        p.start()
    return _watch(procs, results, ranks)


def _child(plan, rank, init, opts, timeout_s, progress, threads, results, micro_batches) -> None:
    """A spawned stage process of ``hetplan exec``: the last rank puts the result on ``results``."""
    result = as_process(Ranks.of(plan.pipeline).name(rank), threads, run_rank, plan, rank, init, opts, timeout_s,
                        progress, micro_batches)
    if result is not None:  # as bytes: tensors put on a queue as such live in shared memory
        buf = io.BytesIO()   # that goes when this process exits, before the launcher reads them
        torch.save(result, buf)
        results.put(buf.getvalue())


def as_process(name: str, threads: int, fn, *args, report=None):
    """``fn(*args)`` as a spawned process's whole work, with ``threads`` intra-op threads: its
    errors as one line, exit 2 (3: a bug, 130: Ctrl-C); the line said on stderr, or handed to
    ``report(line)`` (a process whose parent says it)."""
    report = report or say
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    except HetplanError as e:
        report(str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - a bug: one line, and how to get the traceback
        if os.environ.get("HETPLAN_TRACEBACK"):
            raise
        report(f"{name}: internal error: {type(e).__name__}: {e}; please report it (HETPLAN_TRACEBACK=1 prints the "
               f"traceback)")
        sys.exit(3)


def say(text: str, kind: str = "error") -> None:
    """One line on stderr, written at once (one ``write`` to the descriptor: the stage processes
    share it, and a line written in parts can be cut by another process's)."""
    line = "hetplan: {}: {}\n".format(kind, " ".join(text.split()))
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    sys.stderr.flush()
    os.write(fd, line.encode(errors="replace"))


def _watch(procs, results, ranks: Ranks) -> PipelineResult:
    """Wait for every process; the last rank's result, or a HetplanError saying which one failed
    first (each failed process has said why on its own line)."""
    result, failed, deadline = None, [], None
    try:
        while True:
            try:
                result = results.get(timeout=0.2)
            except queue.Empty:
                pass
            codes = [p.exitcode for p in procs]
            failed += [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in dict(failed)]
            if failed and deadline is None:
                deadline = time.monotonic() + GRACE_S
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
    except KeyboardInterrupt:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(5)
        raise
    for p in procs:
        p.join()
    if failed:
        how = [f"{ranks.name(r)} " + (f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with status {c}")
               for r, c in failed]
        raise HetplanError(f"the pipeline run stopped: {', then '.join(how)}")
    if result is None:
        try:
            result = results.get(timeout=5)
        except queue.Empty:
            raise HetplanError("the pipeline run ended without a result from its last stage") from None
    return torch.load(io.BytesIO(result), weights_only=False)
