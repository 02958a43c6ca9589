"""``hetplan compile``: MODEL + NODE + workload -> plan.json (and, on request, the baselines beside it).

A thin shell over ``hetplan.compiler.compile_plan`` and ``hetplan.plan.compare.compare``: parse
options, write the plan atomically, print a summary (or one JSON object with ``--json``).
Notes for the user (e.g. which dtype ``--weight-dtype auto`` chose) always go to stderr.
"""

from __future__ import annotations

import dataclasses
import json

import click

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.dtypes import BITS_PER_ELEMENT
from hetplan.errors import HetplanError
from hetplan.pipeline.record import replicas_of
from hetplan.plan import write_atomic
from hetplan.files import distinct_targets, writable_target
from hetplan.schema.fields import MAX_NODES_MAX, TIME_LIMIT_MAX_S
from hetplan.units import format_bytes, format_percent, format_seconds

_DTYPES = ", ".join(BITS_PER_ELEMENT)
_DEFAULTS = {f.name: f for f in dataclasses.fields(CompileRequest)}

_EPILOG = """\b
Examples:
  hetplan compile llama-3.1-70b --hw rtx4090-64g -o plan.json
  hetplan compile ./Llama-3.1-8B/config.json --hw node.yaml --prompt-len 4096 --compare
  hetplan compile mixtral-8x7b --hw rtx4090-64g --strategy ngl:16 --json
  hetplan compile opt-30b --hw t4-208g --objective throughput --batch 64
"""


@click.command("compile", epilog=_EPILOG)
@click.argument("model")
@click.option("--hw", "hw", required=True, metavar="NODE",
              help="Machine: a node preset name (e.g. rtx4090-64g) or a node.yaml path.")
@click.option("-o", "--output", default="plan.json", show_default=True, metavar="FILE",
              help="Where to write the plan (written atomically; byte-identical for identical inputs).")
@click.option("--strategy", default="ilp", show_default=True, metavar="NAME",
              help="ilp (exact MILP), all-gpu, greedy (Accelerate device_map=auto), ngl[:N] "
                   "(llama.cpp -ngl; N omitted = what --fit picks), ngl-nkvo[:N] (-ngl N -nkvo), "
                   "stream (FlexGen-style), flexgen[:W] (FlexGen --percent W; W omitted = the most that fits), cpu-moe, n-cpu-moe[:N] (llama.cpp --cpu-moe, --n-cpu-moe), "
                   "ktransformers (experts on the CPU in both phases).")
@click.option("--objective", default="latency", show_default=True,
              type=click.Choice(["latency", "ttft", "tpot", "throughput"]),
              help="What to minimise: latency = TTFT + gen-len x TPOT; ttft; tpot; throughput = "
                   "generated tokens/s, searching batch 1, 2, 4, ... up to --batch.")
@click.option("--batch", default=1, show_default=True, type=int,
              help="Sequences decoded together (the largest batch tried with --objective throughput).")
@click.option("--prompt-len", default=512, show_default=True, type=int, metavar="TOKENS",
              help="Prompt tokens per sequence (prefill).")
@click.option("--gen-len", default=128, show_default=True, type=int, metavar="TOKENS",
              help="Generated tokens per sequence; the KV cache is sized for prompt + gen tokens.")
@click.option("--prefill-chunk", default=None, type=int, metavar="TOKENS",
              help="Prompt tokens per sequence processed together in prefill (default: the planner tries "
                   "512, 1024, ... up to the prompt and keeps the smallest that is as fast as any larger).")
@click.option("--weight-dtype", default="auto", show_default=True, metavar="DTYPE",
              help=f"Weight storage dtype: auto (the checkpoint's dtype if everything fits in GPU + CPU "
                   f"memory, else q8_0, else q4_k_m) or one of {_DTYPES}.")
@click.option("--kv-dtype", default=None, metavar="DTYPE",
              help="KV cache dtype (default: the checkpoint's dtype, e.g. bf16, also when the weights are "
                   "quantised).")
@click.option("--gpu-mem", default=None, metavar="SIZE",
              help="Usable GPU memory, replacing the node's (total - reserve), e.g. 20GiB or 16GB.")
@click.option("--cpu-mem", default=None, metavar="SIZE",
              help="Usable CPU memory, replacing the node's (total - reserve), e.g. 48GiB.")
@click.option("--time-limit", "time_limit_s", default=_DEFAULTS["time_limit_s"].default, show_default=True,
              type=float, metavar="SECONDS",
              help="ILP wall-clock limit per staging depth; when hit, the best plan found is kept, its "
                   "status says time_limit with the MIP gap, and it may differ between machines.")
@click.option("--max-nodes", default=_DEFAULTS["max_nodes"].default, show_default=True, type=int, metavar="N",
              help="ILP branch-and-bound nodes per MILP solved (100 N for the count MILP of a model with "
                   "identical layers): a deterministic limit (the same plan on every machine); when hit, "
                   "the status says node_limit with the MIP gap.")
@click.option("--mip-gap", default=_DEFAULTS["mip_gap"].default, show_default=True, type=float, metavar="REL",
              help="ILP relative optimality gap at which the search stops and calls the plan optimal "
                   "(over several devices, also the pipeline split's: 0 solves every split that could be "
                   "cheaper by any amount).")
@click.option("--stream-cold-experts", is_flag=True,
              help="MoE models: let the ILP also stream a resident layer's CPU-side experts to the GPU "
                   "per phase (pays for long prefills; the MILP gets several times slower to solve).")
@click.option("--routing", default=None, metavar="FILE",
              help="Routing statistics of an MoE model (written by `hetplan exec --record-routing`): "
                   "the hottest experts of each layer are the ones kept on the GPU. Uniform when absent. "
                   "The plan records the statistics, so `hetplan check` recompiles without the file.")
@click.option("--dump-lp", default=None, metavar="FILE",
              help="Also write the MILP in LP format, one file per staging depth tried "
                   "(model.lp -> model.depth1.lp, model.depth2.lp).")
@click.option("--compare", is_flag=True,
              help="Print the plan beside every baseline (all-gpu, greedy, best ngl:N and ngl-nkvo:N, "
                   "stream; for MoE models also cpu-moe, best n-cpu-moe:N and ktransformers) on the same model, machine and "
                   "workload: TTFT, TPOT, memory, fits?, ratio, and the tool version each baseline follows.")
@click.option("--serve", is_flag=True,
              help="Plan for `hetplan serve`: compile at running batches 1, 2, 4, ... up to --max-batch, keep the "
                   "most throughput within the SLOs, size the KV pools and record the throughput/latency curve "
                   "against load in the plan's 'serving' (replaces --batch and --objective).")
@click.option("--max-batch", default=None, type=int, metavar="N",
              help="With --serve: the largest running batch considered (default 64).")
@click.option("--max-context", default=None, type=int, metavar="TOKENS",
              help="With --serve: prompt + max_tokens of one request at most (default: --prompt-len + --gen-len).")
@click.option("--slo-tpot", default=None, type=float, metavar="MS",
              help="With --serve: predicted time per output token at most, in milliseconds.")
@click.option("--slo-ttft", default=None, type=float, metavar="MS",
              help="With --serve: predicted time to first token at most, in milliseconds.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (path, predicted, memory, solver with solve_seconds, compile_seconds and compile_cpu_seconds, notes"
                   "[, compare]) to stdout and nothing else there.")
def command(model, hw, output, strategy, objective, batch, prompt_len, gen_len, prefill_chunk, weight_dtype, kv_dtype,
            gpu_mem, cpu_mem, time_limit_s, max_nodes, mip_gap, stream_cold_experts, routing, dump_lp, compare,
            serve, max_batch, max_context, slo_tpot, slo_ttft, as_json):
    """Plan MODEL on a machine and write the plan.

    MODEL is a preset name (e.g. llama-3.1-70b), a Hugging Face config.json, a directory holding
    one, an .onnx file, or a .gguf file."""
    if not 0 < time_limit_s <= TIME_LIMIT_MAX_S:  # also refuses nan
        raise click.BadParameter(f"must be a positive number of seconds, at most {TIME_LIMIT_MAX_S:g} "
                                 f"(about 4 months)", param_hint="--time-limit")
    if not 0 < max_nodes <= MAX_NODES_MAX:
        raise click.BadParameter(f"must be a positive number of nodes, at most {MAX_NODES_MAX:g}",
                                 param_hint="--max-nodes")
    if not 0 <= mip_gap < 1:
        raise click.BadParameter("must be a relative gap in [0, 1), e.g. 1e-4", param_hint="--mip-gap")
    if prefill_chunk is not None and prefill_chunk <= 0:
        raise click.BadParameter("must be a positive number of tokens", param_hint="--prefill-chunk")
    if prefill_chunk is not None and 0 < prompt_len < prefill_chunk:
        raise click.BadParameter(f"{prefill_chunk} tokens is more than the prompt ({prompt_len}); give at most "
                                 f"{prompt_len} (the whole prompt in one chunk)", param_hint="--prefill-chunk")
    req = CompileRequest(model=model, hw=hw, batch=batch, prompt_len=prompt_len, gen_len=gen_len,
                         prefill_chunk=prefill_chunk,
                         objective=objective, strategy=strategy, weight_dtype=weight_dtype,
                         kv_dtype=kv_dtype, gpu_mem=gpu_mem, cpu_mem=cpu_mem, time_limit_s=time_limit_s,
                         max_nodes=max_nodes, mip_gap=mip_gap, stream_cold_experts=stream_cold_experts,
                         routing=routing, dump_lp=dump_lp)
    distinct_targets({"-o": output}, {"MODEL": model, "--hw": hw, "--routing": routing})
    writable_target(output, "-o")  # a bad -o fails before the solve, not after it
    if dump_lp:
        if strategy != "ilp":
            raise HetplanError(f"--dump-lp writes the MILPs of --strategy ilp; --strategy {strategy} solves none: "
                               f"drop --dump-lp or use --strategy ilp")
        writable_target(dump_lp, "--dump-lp")
    serving = serving_request(serve, batch, objective, compare, max_batch, max_context, slo_tpot, slo_ttft)
    if serving is not None:
        from hetplan.serving import compile_serving
        plan, took = compile_serving(req, serving)
    else:
        plan, took = compile_plan(req)
    for note in req.notes:
        click.echo(f"note: {note}", err=True)
    rows = None
    if compare:
        from hetplan.plan.compare import compare as compare_plans
        from hetplan.plan.compare import compare_dicts
        rows = compare_dicts(compare_plans(plan, req))
    write_atomic(output, plan.to_json(), option="-o")  # last: Ctrl-C before it leaves nothing written
    if as_json:
        doc = {"path": str(output), "predicted": plan.predicted, "memory": plan.memory,
               "solver": dict(plan.solver, solve_seconds=took.solve_s, compile_seconds=took.wall_s,
                                 compile_cpu_seconds=took.cpu_s), "notes": list(req.notes)}
        if rows is not None:
            doc["compare"] = rows
        if plan.serving is not None:
            doc["serving"] = plan.serving
        click.echo(json.dumps(doc, sort_keys=True))
        return
    p, m, s = plan.predicted, plan.memory, plan.solver
    gap = "" if s.get("mip_gap") is None else f", gap {format_percent(s['mip_gap'])}"
    tiers = ("gpu", "cpu") if plan.hardware.gpus else ("cpu",)
    memory = ", ".join(f"{t.upper()} {format_bytes(m[f'{t}_bytes'])} / {format_bytes(m[f'{t}_budget_bytes'])}"
                       for t in tiers)
    click.echo(f"wrote {output}: TTFT {format_seconds(p['ttft_s'])}, TPOT {format_seconds(p['tpot_s'])} "
               f"({p['decode_tokens_per_s']:.2f} tok/s), {memory}  [{plan.model.weight_dtype} weights, "
               f"batch {plan.workload.batch}, {s['strategy']}, {s['status']}{gap}, "
               f"compiled in {took.wall_s:.2f} s, {took.cpu_s:.2f} s CPU]")
    if plan.pipeline is not None:
        pp = plan.pipeline["predicted"]
        r = plan.pipeline.get("replicas") or 1
        what = (f"{r} replicas of a pipeline over {len(plan.pipeline['stages'])} device(s) each "
                f"({plan.pipeline.get('devices', '?')} devices; rates: all replicas together)" if r > 1 else
                f"pipeline over {len(plan.pipeline['stages'])} of {plan.pipeline.get('devices', '?')} devices")
        click.echo(f"  {what}: TTFT {format_seconds(pp['ttft_s'])}, TPOT {format_seconds(pp['tpot_s'])} "
                   f"({pp['decode_tokens_per_s']:.2f} tok/s; the figures before are its first stage alone)")
        for name, b in sorted(plan.pipeline.get("baselines", {}).items()):
            click.echo(f"  {name}: " + (f"TTFT {format_seconds(b['ttft_s'])}, TPOT {format_seconds(b['tpot_s'])} "
                                        f"({b['decode_tokens_per_s']:.2f} tok/s; the pipeline "
                                        f"{pp['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x)"
                                        if b.get("fits") else "does not fit"))
    elif len(plan.hardware.gpus) > 1:
        click.echo(f"  only the first of {len(plan.hardware.gpus)} GPUs is planned ({plan.hardware.gpu.name})")
    if plan.serving is not None:
        sv = plan.serving
        at = max((p for p in sv["curve"] if p["batch"] <= sv["batch"]), key=lambda p: p["batch"])
        r = replicas_of(plan)
        each = (f"{r} replicas, each: " if r > 1 else "")
        together = (f" ({r * at['throughput_tokens_per_s']:.2f} tok/s at {r * at['arrival_rate_per_s']:.3g} "
                    f"requests/s all together)" if r > 1 else "")
        click.echo(f"  serving: {each}running batch <= {sv['batch']}, {at['throughput_tokens_per_s']:.2f} tok/s at "
                   f"{at['arrival_rate_per_s']:.3g} requests/s{together}; KV blocks of {sv['block_tokens']} tokens: "
                   f"{sv['gpu_blocks']} running, {sv['cpu_blocks']} in DRAM; CPU attention "
                   f"{'on' if sv['cpu_attention'] else 'off'} (`hetplan show` draws the curve)")
    if rows is not None:
        from hetplan.plan.report import compare_table
        click.echo("")
        click.echo(compare_table(rows, plan.workload.objective))


def serving_request(serve, batch, objective, compare, max_batch, max_context, slo_tpot_ms, slo_ttft_ms):
    """The ``--serve`` options as a ServingRequest (None without ``--serve``); the serving options
    without it, or the options it replaces beside it, are one-line errors."""
    given = [flag for flag, v in (("--max-batch", max_batch), ("--max-context", max_context),
                                  ("--slo-tpot", slo_tpot_ms), ("--slo-ttft", slo_ttft_ms)) if v is not None]
    if not serve:
        if given:
            raise HetplanError(f"{given[0]}: only with --serve (a serving plan); add --serve or drop {given[0]}")
        return None
    if batch != 1 or objective != "latency":
        flag = "--batch" if batch != 1 else "--objective"
        raise HetplanError(f"{flag}: --serve chooses the running batch for throughput within the SLOs; drop "
                           f"{flag} and give --max-batch (and --slo-tpot / --slo-ttft) instead")
    if compare:
        raise HetplanError("--compare: compares one fixed batch; drop it with --serve")
    from hetplan.serving import ServingRequest
    ms = {k: None if v is None else v / 1e3 for k, v in (("tpot", slo_tpot_ms), ("ttft", slo_ttft_ms))}
    return ServingRequest(max_batch=64 if max_batch is None else max_batch, max_context=max_context,
                          slo_tpot_s=ms["tpot"], slo_ttft_s=ms["ttft"])
