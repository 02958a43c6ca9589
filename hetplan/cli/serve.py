"""``hetplan serve``: answer OpenAI-style requests for a plan's model over HTTP.

The engine's sizes come from the plan (``hetplan.runtime.serve.settings``) unless a flag sets
them. A plan with a pipeline is served by one process per stage
(``hetplan.runtime.serve.pipeline``); a plan with replicas by one process per replica (each
with its stages' processes) behind a front that deals the requests among them
(``hetplan.runtime.serve.replicas``; under torchrun, one process per stage of every replica over
every node, rank 0 running the front). Needs the runtime (torch) and the ``serve`` extra
(starlette, uvicorn, httpx).
"""

from __future__ import annotations

import click

from hetplan.cli.app import require_torch
from hetplan.errors import HetplanError
from hetplan.pipeline.record import replicas_of, whole_model
from hetplan.plan import load_plan
from hetplan.progress import quiet, step


def pipelined(plan) -> bool:
    """Whether the plan runs over several devices (a pipeline of stages, or replicas of one)."""
    pp = plan.pipeline
    return bool(pp) and (len(pp.get("stages", [])) > 1 or (pp.get("replicas") or 1) > 1)


def _int(help_text: str):
    return dict(default=None, type=click.IntRange(0, None), help=help_text)


@click.command("serve")
@click.argument("plan_path", metavar="PLAN")
@click.option("--weights", required=True, help="Checkpoint directory (safetensors, with its tokenizer if any), or 'random'.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--emulate/--no-emulate", default=None,
              help="Run the plan's GPU work on the CPU (default: when torch sees no CUDA device).")
@click.option("--block-tokens", **_int("Positions per KV block (default 16)."))
@click.option("--gpu-blocks", **_int("KV blocks in the GPU tier (default: the plan's KV bytes)."))
@click.option("--cpu-blocks", **_int("KV blocks in DRAM for swapped-out requests (default: as many as the GPU's)."))
@click.option("--max-batch", **_int("Running requests at most (default: min(64, GPU blocks))."))
@click.option("--max-waiting", **_int("Queued requests at most; more get HTTP 429 (default 256)."))
@click.option("--max-context", **_int("Prompt + max_tokens at most (default: the plan's context)."))
@click.option("--prefill-chunk", **_int("Prompt tokens per request per step (default: the plan's chunk, else 256)."))
@click.option("--cpu-attention/--no-cpu-attention", default=None,
              help="Requests swapped out to DRAM keep decoding there, attention on the CPU (default: off).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1), help="Seeds random weights.")
@click.option("--dist-timeout", default=300.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="A plan with a pipeline or replicas: seconds to wait for the processes' rendezvous and for "
                   "any one message between them (under torchrun, also for a process's pulse).")
def command(plan_path, weights, host, port, emulate, block_tokens, gpu_blocks, cpu_blocks, max_batch, max_waiting,
            max_context, prefill_chunk, cpu_attention, seed, dist_timeout):
    """Serve PLAN's model: /v1/completions, /v1/chat/completions, /health, /metrics. A plan with
    a pipeline runs one process per stage (spawned here, or one torchrun process each)."""
    plan = load_plan(plan_path)
    replicas = replicas_of(plan)
    if replicas > 1:
        from hetplan.runtime.serve.replicas.launch import refuse_unserved
        refuse_unserved(plan, plan_path)
    require_torch("serve")
    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
        import httpx  # noqa: F401
    except ImportError:
        raise HetplanError("hetplan serve needs starlette, uvicorn and httpx; run "
                           "`pip install -e '.[runtime,serve]'`") from None
    from hetplan.runtime.serve.api.server import serve_forever
    from hetplan.runtime.serve.load import load_engine
    from hetplan.runtime.serve.settings import settings_for

    settings = settings_for(plan, block_tokens=block_tokens, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                            max_batch=max_batch, max_waiting=max_waiting, max_context=max_context,
                            prefill_chunk=prefill_chunk, cpu_attention=cpu_attention)
    if replicas > 1:
        _serve_replicas(plan, plan_path, weights, settings, host, port, emulate, seed, dist_timeout)
        return
    with step("loading the model"):
        if pipelined(plan):
            from hetplan.runtime.serve.pipeline.launch import start_engine
            engine = start_engine(plan, weights, settings, emulate=emulate, seed=seed, timeout_s=dist_timeout)
            if engine is None:  # a torchrun process of a later stage: it served until stage 0 stopped
                return
        else:
            engine = load_engine(plan, weights, settings, emulate=emulate, seed=seed)
    quiet()  # serving waits for requests by design: no "still working" lines
    running_in = {"cuda": "GPU", "emulated": "emulated GPU", "cpu": "DRAM"}[engine.mode]
    name = whole_model(plan).name
    stages = len(plan.pipeline["stages"]) if pipelined(plan) else 1
    where = f" as a pipeline of {stages} stages, one process each" if stages > 1 else ""
    per = (f" in each stage, {engine.request_blocks} per group of requests ({stages} groups in flight)"
           if stages > 1 else "")
    click.echo(f"hetplan serve: {name} on http://{host}:{port}{where}; KV blocks of {settings.block_tokens} "
               f"tokens: {engine.pool.alloc.n_blocks['gpu']} for running requests ({running_in}){per}, "
               f"{engine.pool.alloc.n_blocks['cpu']} for swapped ones (DRAM); batch <= {settings.max_batch}, "
               f"queue <= {settings.max_waiting}", err=True)
    serve_forever(engine, host, port, name)


def _serve_replicas(plan, plan_path, weights, settings, host, port, emulate, seed, dist_timeout) -> None:
    from hetplan.pipeline.record import stage_plan
    from hetplan.runtime.distributed.launch import under_torchrun
    from hetplan.runtime.serve.pipeline.groups import pool_blocks
    from hetplan.runtime.session import choose_mode

    pp = plan.pipeline
    replicas, stages = pp["replicas"], len(pp["stages"])
    if stages > 1:
        pool_blocks(settings, stages)   # refused here, before any process starts, as one pipeline's launch does
    running_in = {"cuda": "GPU", "emulated": "emulated GPU", "cpu": "DRAM"}[choose_mode(stage_plan(plan, 0), emulate)]
    each = (f"a pipeline of {stages} stages, one process each" if stages > 1 else
            f"one {running_in} in one process")
    apart = pp.get("replica_step") or {}
    own = (f" on {apart['nodes']} node(s) of its own" if "nodes" in apart else
           f" on {apart['gpus']} GPU(s) of its own" if apart.get("gpus") else "")

    def ready(front: bool = True):
        quiet()
        if not front:   # a torchrun process other than rank 0's: rank 0 says it
            return
        click.echo(f"hetplan serve: {replicas} replicas of {whole_model(plan).name} on http://{host}:{port}, each "
                   f"{each}{own}; requests go to the replica with the fewest in flight; each replica: KV blocks "
                   f"of {settings.block_tokens} tokens: {settings.gpu_blocks} for running requests ({running_in}), "
                   f"{settings.cpu_blocks} for swapped ones (DRAM); batch <= {settings.max_batch}, queue <= "
                   f"{settings.max_waiting}", err=True)

    with step(f"loading the model in {replicas} replicas"):   # ready() quiets the heartbeat
        if under_torchrun():
            from hetplan.runtime.serve.replicas.torchrun import serve_under_torchrun
            serve_under_torchrun(plan, weights, settings, host, port, emulate=emulate, seed=seed,
                                 timeout_s=dist_timeout, on_ready=ready)
        else:
            from hetplan.runtime.serve.replicas.launch import serve_replicas
            serve_replicas(plan, plan_path, weights, settings, host, port, emulate=emulate, seed=seed,
                           timeout_s=dist_timeout, on_ready=ready)
