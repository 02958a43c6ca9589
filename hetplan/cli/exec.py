"""``hetplan exec``: run a plan with the torch runtime and compare the run with the prediction."""

from __future__ import annotations

import json
import sys

import click

from hetplan.cli.app import require_torch
from hetplan.errors import HetplanError
from hetplan.files import distinct_targets, writable_target
from hetplan.plan import load_plan, write_atomic
from hetplan.progress import activity, cancellable, printed, step
from hetplan.units import format_bytes, format_seconds


class _Progress:
    """Progress on stderr: one updating line on a terminal; otherwise a line when a stage starts,
    at each quarter of prefill (layers done; as issued on a CUDA GPU) and of decode, and when a
    stage ends."""

    def __init__(self, first_note: str | None = None):
        self.tty = sys.stderr.isatty()
        self.last = None
        self.first_note = first_note
        """Shown when the run starts (after the inputs were accepted), so a refused run says one line."""

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.first_note:
            click.echo(f"note: {self.first_note}", err=True)
            self.first_note = None
        label = {"loading": "loading weights", "prefill": "prefill", "decode": "decode"}[stage]
        unit = {"loading": " blocks", "prefill": " layers", "decode": " tokens"}[stage]
        line = f"{label} {done}/{total}{unit}"
        activity(line)  # what the heartbeat repeats while a layer or a token takes long
        if self.tty:
            click.echo(f"\r\033[K{line}", err=True, nl=False)
            if done == total:
                click.echo("", err=True)
            printed()
            return
        mark = (stage, done * 4 // max(1, total) if stage != "loading" else done == total)
        if mark != self.last:
            click.echo(line, err=True)
            printed()
            self.last = mark


@click.command("exec")
@click.argument("plan_path", metavar="PLAN")
@click.option("--weights", default=None, help="Checkpoint directory (safetensors), a .gguf file, or 'random'.")
@click.option("--model", "model_path", default=None,
              help="For a plan compiled from an .onnx model: the graph to run (default: the path in the plan).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1),
              help="Seeds random weights, the default prompt and sampling.")
@click.option("--prompt", default=None, help="Prompt text (needs a tokenizer beside the weights).")
@click.option("--prompt-ids", default=None, help="Prompt token ids: 1,2,3 (or 1,2;3,4 per sequence).")
@click.option("--gen-len", default=None, type=int, help="Tokens to generate (default: the plan's).")
@click.option("--greedy", is_flag=True, help="Greedy decoding (the default).")
@click.option("--temperature", default=None, type=float, help="Sample from softmax(logits / T).")
@click.option("--trace", "trace_path", default=None, help="Write measured and predicted task times (Chrome/Perfetto JSON).")
@click.option("--emulate/--no-emulate", default=None,
              help="Run the plan's GPU on the CPU (default: when torch sees no CUDA device).")
@click.option("--record-routing", "routing_path", default=None,
              help="Write how often each expert was chosen (MoE models; hetplan.routing format).")
@click.option("--json", "as_json", is_flag=True, help="Print the run's metrics as one JSON object.")
@click.option("--dist-timeout", default=300.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="A plan with a pipeline: seconds to wait for the stage processes' rendezvous and for any "
                   "one message between them.")
@click.option("--micro-batches", default=None, type=click.IntRange(1, 4096),
              help="A plan with a pipeline: groups of the plan's batch that flow through the stages together "
                   "(default: 1; a throughput plan's, one per stage).")
def command(plan_path, weights, model_path, seed, prompt, prompt_ids, gen_len, greedy, temperature, trace_path,
            emulate, routing_path, as_json, dist_timeout, micro_batches):
    """Execute PLAN: place the weights as planned, prefill, decode, report measured vs predicted."""
    distinct_targets({"--trace": trace_path, "--record-routing": routing_path},
                     {"PLAN": plan_path, "--weights": weights, "--model": model_path})
    for option, target in (("--trace", trace_path), ("--record-routing", routing_path)):
        if target:
            writable_target(target, option)  # before the run, not after it
    if greedy and temperature is not None:
        raise HetplanError("--greedy and --temperature: give one of them")
    if temperature is not None and not 0 < temperature < float("inf"):
        raise HetplanError(f"--temperature {temperature}: must be a finite number > 0 (use --greedy for argmax)")
    if gen_len is not None and gen_len < 1:
        raise HetplanError(f"--gen-len {gen_len}: must be at least 1")
    require_torch("exec")  # after the checks that need no torch, so a mistake is refused at once
    from hetplan.runtime.prompt import parse_prompt_ids
    from hetplan.runtime.session import RunOptions, choose_mode, run_plan

    plan = load_plan(plan_path)
    if plan.model.extra.get("source") == "onnx" or model_path is not None:
        from hetplan.frontends.onnx.importer import with_onnx_file
        if weights is not None:
            raise HetplanError("--weights: a plan compiled from an ONNX model runs the graph's own weights; "
                               "drop --weights (use --model to point at the .onnx)")
        plan = with_onnx_file(plan, model_path or plan.model.extra["onnx_path"])
        weights = "random"  # unused: the ONNX backend reads the graph's initializers
    elif weights is None:
        raise HetplanError("--weights: required: a checkpoint directory (safetensors), or 'random'")
    opts = RunOptions(weights=weights, seed=seed, prompt=prompt,
                      prompt_ids=parse_prompt_ids(prompt_ids) if prompt_ids is not None else None,
                      gen_len=gen_len, temperature=temperature or 0.0, emulate=emulate,
                      trace=trace_path is not None, record_routing=routing_path is not None)
    if plan.pipeline is not None:
        from hetplan.cli import exec_pipeline
        exec_pipeline.refuse_unsupported(trace_path, routing_path)
        with step("running the pipeline, one process per stage (Ctrl-C stops)"), cancellable():
            exec_pipeline.run(plan, opts, dist_timeout, as_json, _Progress(None), micro_batches)
        return
    if micro_batches is not None:
        raise HetplanError("--micro-batches: only for a plan with a pipeline (this plan runs on one device); "
                           "drop --micro-batches, or raise the batch with `hetplan compile --batch`")
    note = None
    if emulate is None and choose_mode(plan, None) == "emulated":
        note = "no CUDA device: the plan's GPU is emulated on the CPU (--emulate)"
    with step("running the plan (Ctrl-C stops)"), cancellable():
        result = run_plan(plan, opts, progress=_Progress(note))
    if trace_path:
        write_atomic(trace_path, json.dumps(result.trace) + "\n", option="--trace")
    if routing_path:
        from hetplan.routing import write_routing
        write_routing(routing_path, result.routing)
    if as_json:
        click.echo(json.dumps(result.to_json_dict(), sort_keys=True))
        return
    _report(result, trace_path, routing_path)


def _report(r, trace_path, routing_path) -> None:
    mode = {"cuda": "CUDA GPU", "emulated": "emulated GPU (CPU)", "cpu": "CPU only"}[r.mode]
    click.echo(f"ran on {mode}")
    for i, seq in enumerate(r.tokens):
        click.echo(f"sequence {i}: {' '.join(map(str, seq))}")
        if r.text:
            click.echo(f"  text: {r.text[i]!r}")
    click.echo(f"{'':18}{'measured':>13}{'predicted':>13}{'error':>11}")
    for key, label in (("ttft_s", "TTFT (warm)"), ("tpot_s", "TPOT"), ("decode_tokens_per_s", "decode tokens/s")):
        m, p, e = r.measured[key], r.predicted[key], r.relative_error[key]
        fmt = (lambda v: f"{v:.1f}") if key == "decode_tokens_per_s" else format_seconds
        error = f"{e:+.1%}" if e is not None else ("n/a" if not r.comparable else "-")
        click.echo(f"{label:18}{fmt(m) if m is not None else '-':>13}{fmt(p):>13}{error:>11}")
    if r.measured.get("cold_ttft_s") is not None:
        click.echo(f"{'TTFT (cold)':18}{format_seconds(r.measured['cold_ttft_s']):>13}")
    if not r.comparable:
        click.echo("times not comparable with the plan: its GPU was emulated on the CPU, so the run measured "
                   "the CPU, not the plan's GPU")
    for tier in ("gpu", "cpu"):
        if r.mode == "cpu" and tier == "gpu":
            continue
        click.echo(f"{f'peak {tier.upper()} memory':18}{format_bytes(r.peak_bytes[tier]):>13}"
                   f"{format_bytes(r.planned_bytes[tier]):>13}")
        if tier == "gpu" and "gpu_reserved" in r.peak_bytes:
            click.echo(f"{'  GPU reserved':18}{format_bytes(r.peak_bytes['gpu_reserved']):>13}")
    if r.pinned_bytes:
        click.echo(f"{'pinned host memory':18}{format_bytes(r.pinned_bytes):>13}")
    if r.h2d_bytes_per_s:
        click.echo(f"weight loads achieved {format_bytes(r.h2d_bytes_per_s)}/s")
    for path in (trace_path, routing_path):
        if path:
            click.echo(f"wrote {path}")
