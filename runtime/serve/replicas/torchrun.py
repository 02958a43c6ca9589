"""``hetplan serve`` over a plan with replicas under torchrun: one process per stage of every
replica, over every node (one torchrun command per node, the same rendezvous), as ``hetplan
exec`` runs them (``distributed.launch``): ``WORLD_SIZE`` is R x S, process ``RANK`` is replica
``RANK // S``'s stage ``RANK % S``, on the node and GPU exec puts it on (``ranks.Ranks``:
replicas on nodes of their own, ``replica_step.nodes``, or side by side on one node's GPUs).

- Every process joins one process group (``env://``), checks its node and places its stage
  (``launch.ready``: a process that cannot start stops every one, one line each).
- Each replica serves as a served pipeline does (``serve.pipeline``): its first stage's process
  holds the engine (a ``PipelineEngine``; a one-stage replica, a plain ``Engine``), its later
  stages run ``serve_stage``; their messages go along the replica's own chain (``Peers`` over
  the replica's global ranks).
- Each replica's first stage serves HTTP on a free port at the address its node reaches the
  rendezvous from (``advertised``: the one rank 0's node can reach it at;
  ``HETPLAN_SERVE_ADDRESS`` overrides it); the addresses are exchanged once, at startup.
- Rank 0 (replica 0's first stage) serves replica 0 on 127.0.0.1 and runs the front
  (``front.make_front``) on ``--host``:``--port`` once every replica answers ``/health``
  (within ``--dist-timeout``).
- After startup nothing goes over the whole world but the ``lifeline``'s pulses, so no replica
  waits on another; a process that fails or dies stops every process (one line each, exit 2),
  Ctrl-C on any node stops them all (exit 0): rank 0 stops as ``hetplan serve`` does on SIGINT,
  the others ask it to (``Lifeline.ask_stop``).

Knows nothing about tensors beyond handing each stage its part.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

from hetplan.errors import HetplanError
from hetplan.pipeline.record import whole_model
from hetplan.runtime.distributed.launch import env_int, named, ready
from hetplan.runtime.distributed.peers import leave
from hetplan.runtime.distributed.ranks import Ranks
from hetplan.runtime.distributed.worker import wire_dtype
from hetplan.runtime.serve.replicas.lifeline import Lifeline
from hetplan.runtime.session import RunOptions

ADDRESS_ENV = "HETPLAN_SERVE_ADDRESS"
"""The address a replica's first stage listens and is reached at, when the route to the
rendezvous does not give it (a node behind NAT, a network of its own for HTTP)."""


def check_world(plan) -> tuple:
    """-> (RANK, WORLD_SIZE) under torchrun, refused in one line unless WORLD_SIZE is R x S."""
    ranks = Ranks.of(plan.pipeline)
    rank, size = env_int("RANK"), env_int("WORLD_SIZE")
    if size != ranks.world or not 0 <= rank < ranks.world:
        raise HetplanError(f"WORLD_SIZE {size}, RANK {rank}: the plan serves {ranks.replicas} replicas x "
                           f"{ranks.stages} stage(s) = {ranks.world} processes, one per stage of each replica; start "
                           f"{ranks.world} processes in all (torchrun --nnodes and --nproc-per-node adding up to "
                           f"{ranks.world})")
    return rank, size


def advertised(environ=None) -> str:
    """The address of this node's interface that reaches the rendezvous (``MASTER_ADDR``), so
    the one rank 0's node reaches it at; ``HETPLAN_SERVE_ADDRESS`` when set. No packet is sent."""
    environ = os.environ if environ is None else environ
    if environ.get(ADDRESS_ENV):
        return environ[ADDRESS_ENV]
    master, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    try:
        family, kind, proto, _, where = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(where)
            return s.getsockname()[0]
    except OSError as e:
        raise HetplanError(f"MASTER_ADDR {master}: no route from this node to the rendezvous ({e.strerror or e}); "
                           f"set {ADDRESS_ENV} to the address rank 0's node reaches this one at") from None


def url_of(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def serve_under_torchrun(plan, weights: str, settings, host: str, port: int, emulate: bool | None = None,
                         seed: int = 0, timeout_s: float = 300.0, on_ready=None) -> None:
    """Be process ``RANK`` of ``plan``'s replicas served under torchrun, until Ctrl-C on any node
    (or a failure anywhere: one line, exit 2); ``on_ready(front)`` once this process serves
    (``front``: rank 0, whose front listens next)."""
    from hetplan.runtime.serve.api.server import check_listen
    from hetplan.runtime.serve.pipeline.stage import StagePart

    ranks = Ranks.of(plan.pipeline)
    rank, _ = check_world(plan)
    stage, name = ranks.split(rank)[1], ranks.name(rank)
    opts = RunOptions(weights=weights, seed=seed, emulate=emulate)

    def prepare(mode):
        if rank == 0:   # an address the front cannot listen at stops every process before serving
            check_listen(host, port)
        return StagePart(plan, stage, settings, weights, seed, mode)

    part, peers = named(name, ready, plan, rank, "env://", opts, timeout_s, 1, prepare)
    try:
        line = Lifeline(ranks, rank, timeout_s)
    except BaseException:
        part.close()
        leave()
        raise
    if rank != 0:   # Ctrl-C here (torchrun passes it on to each process) asks rank 0 to stop every one
        signal.signal(signal.SIGINT, lambda *_: line.ask_stop())
    try:
        if stage > 0:
            _later_stage(plan, part, peers, line, on_ready)
        else:
            _first_stage(plan, part, peers, settings, line, host, port, timeout_s, on_ready)
    except HetplanError as e:
        line.fail(str(e) if str(e).startswith(f"{name}:") else f"{name}: {e}")
    except KeyboardInterrupt:   # rank 0, stopped by Ctrl-C: the others were told to stop
        if not line.stopping.is_set():
            raise
    line.end(0)


def _later_stage(plan, part, peers, line: Lifeline, on_ready) -> None:
    """A replica's stage after the first: its blocks for every step until its first stage stops
    it (``STOP`` down the replica's chain)."""
    from hetplan.runtime.serve.pipeline.stage import serve_stage

    line.gather(None)
    line.start(on_stop=None)
    if on_ready is not None:
        on_ready(False)
    stage = line.ranks.split(line.rank)[1]
    named(line.name, serve_stage, part, peers, stage, line.ranks.stages, wire_dtype(plan))


def _first_stage(plan, part, peers, settings, line: Lifeline, host, port, timeout_s, on_ready) -> None:
    """A replica's first stage: its engine and its server (rank 0: on 127.0.0.1, others: at the
    ``advertised`` address), every replica's address exchanged once it listens; then rank 0
    runs the front until Ctrl-C, the others serve until rank 0 says ``STOP``."""
    from hetplan.runtime.serve.api.server import running

    engine = _engine(plan, part, peers, settings)
    _fail_when_broken(engine, line)
    stopped = threading.Event()
    with running(engine, whole_model(plan).name, host="127.0.0.1" if line.rank == 0 else advertised()) as url:
        urls = line.gather(url)
        line.start(on_stop=stopped.set if line.rank != 0 else lambda: os.kill(os.getpid(), signal.SIGINT))
        if line.rank != 0:
            if on_ready is not None:
                on_ready(False)
            stopped.wait()
            return
        try:
            _front([urls[r] for r in line.ranks.first_stages()], host, port, timeout_s, on_ready)
        finally:
            line.stop_all()   # before replica 0's engine stops: its stages' lines may break from here


def _engine(plan, part, peers, settings):
    """A replica's first stage's engine: a pipeline's (its stages' messages through ``peers``),
    or a plain one for a replica of one stage."""
    stages = len(plan.pipeline["stages"])
    if stages == 1:
        from hetplan.runtime.serve.engine import Engine
        return Engine(part.model, part.pool, settings, tokenizer=part.tokenizer, mode=part.mode)
    from hetplan.runtime.serve.pipeline.engine import PipelineEngine
    try:
        return PipelineEngine(part.model, part.pool, settings, peers, stages, wire_dtype(plan), part.tokenizer,
                              part.mode)
    except BaseException:
        part.close()
        raise


def _fail_when_broken(engine, line: Lifeline) -> None:
    """A pipeline's engine that breaks (one of its replica's stages failed) fails the whole at
    once, with the engine's line: before its server stops and the engine leaves the process
    group, which would break this process's lifeline too."""
    broken = getattr(engine, "broken_event", None)
    if broken is None:
        return

    def watch():
        broken.wait()
        if not line.stopping.is_set():
            text = engine.broken or "the pipeline broke"
            line.fail(text if text.startswith(f"{line.name}:") else f"{line.name}: {text}")
    threading.Thread(target=watch, name="hetplan-serve-broken", daemon=True).start()


def _front(urls: list, host: str, port: int, timeout_s: float, on_ready) -> None:
    """Rank 0: the front over every replica's server (``urls``) on ``host:port`` until Ctrl-C,
    once every one answers ``/health``."""
    import uvicorn

    from hetplan.runtime.serve.replicas.front import make_front
    from hetplan.runtime.serve.replicas.launch import wait_ready

    wait_ready(urls, lambda: None, timeout_s)   # a replica that fails meanwhile ends this process (lifeline)
    app, _ = make_front(urls)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=5))
    if on_ready is not None:
        on_ready(True)
    server.run()
