"""``hetplan serve``: answer OpenAI-style requests for a plan's model over HTTP.

The engine's sizes come from the plan (``hetplan.runtime.serve.settings``) unless a flag sets
them. Needs the runtime (torch) and the ``serve`` extra (starlette, uvicorn).
"""

from __future__ import annotations

import click

from hetplan.cli.app import require_torch
from hetplan.errors import HetplanError
from hetplan.plan import load_plan
from hetplan.progress import quiet, step


def refuse_pipeline(plan, plan_path: str) -> None:
    """A plan over several devices is not served: its main part is its first stage alone."""
    pp = plan.pipeline
    if pp and (len(pp.get("stages", [])) > 1 or (pp.get("replicas") or 1) > 1):
        what = f"{len(pp['stages'])} pipeline stage(s)" + (f" x {pp['replicas']} replicas" if pp.get("replicas") else "")
        raise HetplanError(f"{plan_path}: the plan runs over several devices ({what}), and hetplan serve runs a "
                           f"plan on one GPU only; compile it for serving with a node of one GPU (not a cluster "
                           f"or a multi-GPU node), or run the pipeline with `hetplan exec {plan_path}`")


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
def command(plan_path, weights, host, port, emulate, block_tokens, gpu_blocks, cpu_blocks, max_batch, max_waiting,
            max_context, prefill_chunk, cpu_attention, seed):
    """Serve PLAN's model: /v1/completions, /v1/chat/completions, /health, /metrics."""
    plan = load_plan(plan_path)
    refuse_pipeline(plan, plan_path)
    require_torch("serve")
    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        raise HetplanError("hetplan serve needs starlette and uvicorn; run `pip install -e '.[runtime,serve]'`") from None
    from hetplan.runtime.serve.api.server import serve_forever
    from hetplan.runtime.serve.load import load_engine
    from hetplan.runtime.serve.settings import settings_for

    settings = settings_for(plan, block_tokens=block_tokens, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                            max_batch=max_batch, max_waiting=max_waiting, max_context=max_context,
                            prefill_chunk=prefill_chunk, cpu_attention=cpu_attention)
    with step("loading the model"):
        engine = load_engine(plan, weights, settings, emulate=emulate, seed=seed)
    quiet()  # serving waits for requests by design: no "still working" lines
    running_in = {"cuda": "GPU", "emulated": "emulated GPU", "cpu": "DRAM"}[engine.mode]
    click.echo(f"hetplan serve: {plan.model.name} on http://{host}:{port}; KV blocks of {settings.block_tokens} "
               f"tokens: {settings.gpu_blocks} for running requests ({running_in}), {settings.cpu_blocks} for "
               f"swapped ones (DRAM); batch <= {settings.max_batch}, queue <= {settings.max_waiting}", err=True)
    serve_forever(engine, host, port, plan.model.name)
