"""Start a served pipeline: one process per stage, stage 0 being this one (the server's).

As ``hetplan exec`` starts a pipeline (``hetplan.runtime.distributed.launch``): under
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; one command per node)
this process is rank ``RANK``, rank 0 serving HTTP and the others computing their stage until
rank 0 stops; otherwise this process is stage 0 and spawns one process per later stage
(``torch.multiprocessing``, a TCP rendezvous on 127.0.0.1), which ignore Ctrl-C (this process
stops them); the cores are shared out, ``cores // stages`` intra-op threads each. Each process checks this machine holds its stage, places it, and the processes
agree that every one is ready (``launch.ready``), so a stage that cannot start stops them all,
each with one line. Replicas of the pipeline are served by ``hetplan.runtime.serve.replicas``, each
replica's process starting its stages here. Knows nothing about HTTP.
"""

from __future__ import annotations

import os
import signal

import torch

from hetplan.errors import HetplanError
from hetplan.runtime.distributed.launch import (DEFAULT_TIMEOUT_S, as_process, env_int, free_port, named, ready,
                                                under_torchrun)
from hetplan.runtime.distributed.peers import leave
from hetplan.runtime.distributed.ranks import Ranks
from hetplan.runtime.distributed.worker import stage_device, wire_dtype
from hetplan.runtime.serve.pipeline.engine import PipelineEngine
from hetplan.runtime.serve.pipeline.groups import pool_blocks
from hetplan.runtime.serve.pipeline.stage import StagePart, serve_stage
from hetplan.runtime.session import RunOptions

def refuse_replicas(plan, plan_path: str) -> None:
    """A plan of several replicas reaching one pipeline's launch: each replica is started with a
    plan of its own (``hetplan.runtime.serve.replicas.one_replica``)."""
    r = plan.pipeline.get("replicas") or 1
    if r > 1:
        raise HetplanError(f"{plan_path}: the plan runs {r} replicas of a pipeline of {len(plan.pipeline['stages'])} "
                           f"stage(s), and this starts one; serve it with `hetplan serve`, which starts each replica")


def start_engine(plan, weights: str, settings, emulate: bool | None = None, seed: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cores: int | None = None) -> PipelineEngine | None:
    """Start every stage -> stage 0's engine, not yet stepping; None in a torchrun process of a
    later stage, once it has served until stage 0 stopped. ``cores``: what the stages share out
    (None: this machine's; a replica of a served plan gets its share)."""
    ranks = Ranks.of(plan.pipeline)
    refuse_replicas(plan, "plan")
    world = ranks.world
    pool_blocks(settings, world)   # a pool too small for a group per stage: refused before any process starts
    opts = RunOptions(weights=weights, seed=seed, emulate=emulate)
    children = []
    if under_torchrun():
        rank, size = env_int("RANK"), env_int("WORLD_SIZE")
        if size != world or not 0 <= rank < world:
            raise HetplanError(f"WORLD_SIZE {size}, RANK {rank}: the plan's pipeline runs {world} stage(s), one "
                               f"process each; start {world} processes in all (torchrun --nnodes and "
                               f"--nproc-per-node adding up to {world})")
        init = "env://"
    else:
        for r in range(world):  # a stage this machine cannot run is refused before any process starts
            stage_device(plan, r, emulate)
        rank, init = 0, f"tcp://127.0.0.1:{free_port()}"
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        threads = max(1, (cores or os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)   # this process computes stage 0: the cores shared out as exec does
        children = [ctx.Process(target=_child, name=f"hetplan-serve-stage-{r}", daemon=False,
                                args=(plan, r, init, opts, settings, timeout_s, threads)) for r in range(1, world)]
        for p in children:
            p.start()
    if rank != 0:
        named(f"stage {rank}", _serve_rank, plan, rank, init, opts, settings, timeout_s)
        return None
    try:
        return named("stage 0", _engine, plan, init, opts, settings, timeout_s, children)
    except BaseException:
        for p in children:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
        raise


def _engine(plan, init, opts, settings, timeout_s, children) -> PipelineEngine:
    stages = len(plan.pipeline["stages"])
    part, peers = ready(plan, 0, init, opts, timeout_s, 1,
                        lambda mode: StagePart(plan, 0, settings, opts.weights, opts.seed, mode))
    try:
        engine = PipelineEngine(part.model, part.pool, settings, peers, stages, wire_dtype(plan), part.tokenizer,
                                part.mode)
    except BaseException:
        part.close()
        leave()
        raise
    engine.watch(children)
    return engine


def _serve_rank(plan, rank, init, opts, settings, timeout_s) -> None:
    stages = len(plan.pipeline["stages"])
    part, peers = ready(plan, rank, init, opts, timeout_s, 1,
                        lambda mode: StagePart(plan, rank, settings, opts.weights, opts.seed, mode))
    try:
        serve_stage(part, peers, rank, stages, wire_dtype(plan))
    finally:
        leave()


def _child(plan, rank, init, opts, settings, timeout_s, threads) -> None:
    """A spawned later stage: Ctrl-C is for stage 0's process, which stops this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = f"stage {rank}"
    as_process(name, threads, named, name, _serve_rank, plan, rank, init, opts, settings, timeout_s)
