"""Start a served plan with replicas (``pipeline.replicas`` = R): R replica processes, each the
server a plan of one replica gets (``one_replica``: a single-process engine on its GPU, or the
pipeline engine with its own stage processes), listening on 127.0.0.1 at a port of its own;
this process is the front (``front``), dealing the requests among them.

Each replica runs the first group's plan as planned, on its own group of GPUs: replica ``r``'s
stage on GPU ``g`` runs on the GPU ``hetplan exec`` puts it on (``Ranks.gpu``: ``g + r x
replica_step.gpus``), which the replica process sees as GPU ``g`` (``CUDA_VISIBLE_DEVICES``
holds its group alone, in order). So a replica's engine, and its stage processes, need know
nothing of the others. The processes are spawned (``torch.multiprocessing``) in sessions of
their own: Ctrl-C is the front's, which stops them (SIGINT: each server stops as ``hetplan
serve`` does; any left ``STOP_GRACE_S`` later are killed); a replica whose front is gone stops
itself. The cores are shared out, ``cores // R`` each (then among a pipeline's stages).

Startup: every replica's GPUs are checked before any process starts; the front waits for each
replica's ``/health``, at most ``timeout_s`` (``--dist-timeout``). A replica that fails (at
startup or while serving: its process ends) stops the whole: every replica is stopped, the
requests in flight end with an error, and ``serve_replicas`` raises one line saying which
replica and why (what the replica said, or how its process ended).

Under torchrun every replica plan is served by ``torchrun`` (one process per stage of every
replica, over every node); replicas on nodes of their own (``replica_step.nodes``, a cluster)
started without it are refused in one line saying what to run. Knows nothing about HTTP beyond
``/health``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import httpx

from hetplan.errors import HetplanError
from hetplan.pipeline.record import replicas_of, whole_model
from hetplan.runtime.distributed.launch import DEFAULT_TIMEOUT_S, as_process, free_port, named, under_torchrun
from hetplan.runtime.distributed.ranks import Ranks
from hetplan.runtime.distributed.worker import stage_device

STOP_GRACE_S = 8.0
"""How long the replicas get to stop on their own (SIGINT) before they are killed."""
WATCH_S = 0.2
"""How often the front looks at its replica processes."""


def one_replica(plan):
    """``plan`` as each replica runs it: its pipeline (the first group's stages) without replicas."""
    pp = {k: v for k, v in plan.pipeline.items() if k not in ("replicas", "replica_step")}
    r = replicas_of(plan)
    if pp.get("devices"):
        pp["devices"] = pp["devices"] // r
    return dataclasses.replace(plan, pipeline=pp)


def replica_gpus(plan, r: int) -> list:
    """The GPUs of this node (as ``hetplan exec`` numbers them) that replica ``r`` runs on: its
    group's, the first group's GPU ``g`` being the ``g``-th."""
    ranks = Ranks.of(plan.pipeline)
    q = (plan.pipeline.get("replica_step") or {}).get("gpus") or 0
    return [ranks.gpu(ranks.rank(r, 0), g) for g in range(q)]


def refuse_unserved(plan, plan_path: str) -> None:
    """Replicas on nodes of their own started without torchrun, refused in one line with what to
    run (under torchrun, ``torchrun.serve_under_torchrun`` serves every replica plan)."""
    step = plan.pipeline.get("replica_step") or {}
    if "nodes" in step and not under_torchrun():
        ranks = Ranks.of(plan.pipeline)
        raise HetplanError(f"{plan_path}: the plan runs {ranks.replicas} replicas on nodes of their own "
                           f"({step['nodes']} node(s) each), which hetplan serve does not start from one node; start "
                           f"it under torchrun on every node, one command per node with the same rendezvous "
                           f"(`torchrun --nnodes N --node-rank I --nproc-per-node K --rdzv-endpoint HOST:PORT -m "
                           f"hetplan serve {plan_path} ...`, N x K = {ranks.world} processes)")


def serve_replicas(plan, plan_path: str, weights: str, settings, host: str, port: int, emulate: bool | None = None,
                   seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S, on_ready=None) -> None:
    """Serve ``plan``'s replicas behind a front on ``host:port`` until Ctrl-C (or a replica
    fails: HetplanError); ``on_ready()`` once every replica answers."""
    import torch.multiprocessing as mp
    import uvicorn

    from hetplan.runtime.serve.api.server import check_listen
    from hetplan.runtime.serve.replicas.front import make_front

    refuse_unserved(plan, plan_path)
    check_listen(host, port)
    ranks = Ranks.of(plan.pipeline)
    for rank in range(ranks.world):   # a GPU this machine lacks is refused before any process starts
        stage_device(plan, rank, emulate)
    view, n = one_replica(plan), ranks.replicas
    parent = _visible()
    ctx = mp.get_context("spawn")
    said = ctx.SimpleQueue()
    ports = [free_port() for _ in range(n)]
    threads = max(1, (os.cpu_count() or 1) // n)
    procs = [ctx.Process(target=_replica, name=f"hetplan-serve-replica-{r}", daemon=False,
                         args=(view, r, ports[r], weights, settings, emulate, seed, timeout_s, threads,
                               _devices(parent, replica_gpus(plan, r)), said))
             for r in range(n)]
    for p in procs:
        p.start()
    watch = _Watch(procs, said)
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        wait_ready(urls, watch.failed, timeout_s)
        app, _ = make_front(urls)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                               timeout_graceful_shutdown=5))
        watch.start(lambda: setattr(server, "should_exit", True))
        if on_ready is not None:
            on_ready()
        server.run()
    finally:
        watch.stop()
    if watch.broken:
        raise HetplanError(watch.broken)


class _Watch:
    """The replica processes: whether one has ended (its line, ``broken``), and stopping them."""

    def __init__(self, procs: list, said):
        self.procs, self.said, self.broken = procs, said, None
        self.lines: dict = {}
        """replica -> what it said before it ended (its first line)."""
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False

    def failed(self) -> str | None:
        """What the first replica that ended said (or how its process ended), or None while
        every one runs."""
        self._read()
        for r, p in enumerate(self.procs):
            if p.exitcode is not None:
                time.sleep(WATCH_S)   # what it said before it ended comes through the queue
                self._read()
                return self.lines.get(r) or (f"replica {r} was killed by {signal.Signals(-p.exitcode).name}"
                                        if p.exitcode < 0 else f"replica {r} exited with status {p.exitcode}")
        return None

    def _read(self) -> None:
        while not self.said.empty():
            r, text = self.said.get()
            self.lines.setdefault(r, text)

    def start(self, on_failure) -> None:
        def watch():
            while not self._stopping.is_set():
                line = self.failed()
                if line is not None and not self._stopping.is_set():   # not one that stop() ended
                    self.broken = f"{line}; every replica was stopped, the requests in flight ended with an error"
                    self.stop()   # first: the front's requests in flight fail at once
                    on_failure()
                    return
                self._stopping.wait(WATCH_S)
        threading.Thread(target=watch, name="hetplan-serve-replicas", daemon=True).start()

    def stop(self) -> None:
        """SIGINT every replica still running; kill any left after ``STOP_GRACE_S``."""
        self._stopping.set()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for p in self.procs:
                if p.exitcode is None:
                    try:
                        os.kill(p.pid, signal.SIGINT)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + STOP_GRACE_S
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in self.procs:
                if p.exitcode is None:
                    p.kill()
                    p.join()


def wait_ready(urls: list, failed, timeout_s: float) -> None:
    """Until every replica answers ``/health`` with 200; a replica that ends first (``failed()``:
    its line, or None while every one runs), or the deadline, is a HetplanError."""
    deadline = time.monotonic() + timeout_s
    waiting = set(range(len(urls)))
    while waiting:
        line = failed()
        if line is not None:
            raise HetplanError(line)
        for r in sorted(waiting):
            try:
                if httpx.get(urls[r] + "/health", timeout=2).status_code == 200:
                    waiting.discard(r)
            except httpx.TransportError:
                pass
        if waiting and time.monotonic() > deadline:
            raise HetplanError(f"replica {min(waiting)} did not start within --dist-timeout {timeout_s:g} s; raise "
                               f"--dist-timeout if loading its weights takes longer")
        if waiting:
            time.sleep(WATCH_S)


def _visible() -> list | None:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES lists them (None: every one)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if text is None else [d.strip() for d in text.split(",") if d.strip()]


def _devices(parent: list | None, gpus: list) -> str | None:
    """CUDA_VISIBLE_DEVICES of a replica on ``gpus`` (indices among ``parent``'s, or among all)."""
    if not gpus:
        return None
    return ",".join(parent[g] if parent is not None else str(g) for g in gpus)


def _replica(plan, r, port, weights, settings, emulate, seed, timeout_s, threads, visible, said) -> None:
    """A spawned replica: its server on 127.0.0.1:``port`` until SIGINT; its error, if any, put
    on ``said`` for the front to say (exit 2; 3: a bug)."""
    os.setsid()   # Ctrl-C in a terminal is for the front, which stops this process
    if visible is not None:   # before CUDA starts in this process: the replica's GPUs alone
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    _follow(os.getppid())
    name = f"replica {r}"
    as_process(name, threads, named, name, _serve_one, plan, weights, settings, emulate, seed, timeout_s, port,
               threads, report=lambda line: said.put((r, line)))


def _serve_one(plan, weights, settings, emulate, seed, timeout_s, port, threads) -> None:
    from hetplan.runtime.serve.api.server import serve_forever
    from hetplan.runtime.serve.load import load_engine

    if len(plan.pipeline["stages"]) > 1:
        from hetplan.runtime.serve.pipeline.launch import start_engine
        engine = start_engine(plan, weights, settings, emulate=emulate, seed=seed, timeout_s=timeout_s, cores=threads)
    else:
        engine = load_engine(plan, weights, settings, emulate=emulate, seed=seed)
    serve_forever(engine, "127.0.0.1", port, whole_model(plan).name)


def _follow(parent: int) -> None:
    """Stop this replica (as SIGINT does) once its front is gone."""
    def follow():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=follow, name="hetplan-serve-follow", daemon=True).start()
