"""``hetplan exec`` on a plan with a pipeline: one process per stage (``hetplan.runtime.distributed``),
and the report of the run on the last stage, stage by stage against the plan."""

from __future__ import annotations

import json

import click

from hetplan.errors import HetplanError
from hetplan.units import format_bytes, format_seconds


def refuse_unsupported(trace_path, routing_path) -> None:
    for option, value in (("--trace", trace_path), ("--record-routing", routing_path)):
        if value:
            raise HetplanError(f"{option}: not available for a plan with a pipeline (its stages run in separate "
                               f"processes); drop {option}")


def run(plan, opts, timeout_s: float, as_json: bool, progress, micro_batches: int | None = None) -> None:
    from hetplan.runtime.distributed.launch import run_pipeline

    result = run_pipeline(plan, opts, timeout_s, progress, micro_batches)
    if result is None:  # a torchrun process other than the last rank's: that one reports
        return
    if as_json:
        click.echo(json.dumps(result.to_json_dict(), sort_keys=True))
        return
    report(result)


def report(r) -> None:
    modes = sorted(set(r.modes))
    where = ", ".join({"cuda": "CUDA GPUs", "emulated": "emulated GPUs (CPU)", "cpu": "CPU only"}[m] for m in modes)
    n_rep = max(1, len(r.replicas))
    per_micro = len(r.tokens) // (r.micro_batches * n_rep)
    if n_rep > 1:
        click.echo(f"ran {n_rep} replicas of a pipeline of {len(r.stages) // n_rep} stages, {len(r.stages)} processes "
                   f"(one per stage of each replica), on {where}; each replica {r.micro_batches} micro-batch(es) of "
                   f"{per_micro} sequence(s), replica after replica below")
    else:
        click.echo(f"ran a pipeline of {len(r.stages)} stages, one process each, on {where}; "
                   f"{r.micro_batches} micro-batch(es) of {per_micro} sequence(s)")
    for i, seq in enumerate(r.tokens):
        click.echo(f"sequence {i}: {' '.join(map(str, seq))}")
        if r.text:
            click.echo(f"  text: {r.text[i]!r}")
    click.echo(f"{'':34}{'measured':>13}{'predicted':>13}")
    m, p = r.measured, r.predicted
    rate = lambda v: f"{v:.1f}" if v is not None else "-"   # noqa: E731
    secs = lambda v: format_seconds(v) if v is not None else "-"   # noqa: E731
    rows = [("TTFT (warm)", secs(m["ttft_s"]), secs(p["ttft_s"])),
            ("TPOT (each micro-batch)", secs(m["tpot_s"]), secs(p["tpot_s"]) if r.micro_batches == 1 else "")]
    rows += [(f"replica {e['replica']} decode tokens/s", rate(e["decode_tokens_per_s"]),
              rate(e["predicted_decode_tokens_per_s"])) for e in (r.replicas if n_rep > 1 else ())]
    rows += [("decode tokens/s" + (" (all replicas)" if n_rep > 1 else ""), rate(m["decode_tokens_per_s"]),
              rate(p["micro_batch_decode_tokens_per_s"])),
             ("  pipelined (every stage busy)", "", rate(p["pipelined_decode_tokens_per_s"]))]
    for label, got, want in rows:
        click.echo(f"{label:34}{got:>13}{want:>13}")
    click.echo(("replica " if n_rep > 1 else "") + f"{'stage':8}{'GPU':>5}{'layers':>9}{'busy prefill':>14}"
               f"{'predicted':>11}{'busy decode':>13}{'predicted':>11}{'busy':>11}{'idle':>11}{'peak GPU mem':>14}")
    for s in r.stages:
        a, b = s["layers"]
        busy = sum(s["busy_s"].values())
        idle = sum(s["idle_s"].values())
        click.echo((f"{s.get('replica', 0):<8}" if n_rep > 1 else "") +
                   f"{s['rank']:<8}{s['gpu'] if s['gpu'] is not None else '-':>5}{f'{a}-{b - 1}':>9}"
                   f"{secs(s['busy_prefill_s']):>14}{format_seconds(s['predicted_ttft_s']):>11}"
                   f"{secs(s['busy_decode_s']):>13}{format_seconds(s['predicted_tpot_s']):>11}"
                   f"{format_seconds(busy):>11}{format_seconds(idle):>11}"
                   f"{format_bytes(s['peak_bytes'].get('gpu', 0)):>14}")
    click.echo("busy prefill / busy decode: one micro-batch's pass; busy / idle: the whole timed run (idle: "
               "waiting for the stage before or for the token)")
    if not r.comparable:
        click.echo("times not comparable with the plan: GPUs were emulated on the CPU, so the run measured the CPU")
