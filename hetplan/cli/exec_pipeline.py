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


def run(plan, opts, timeout_s: float, as_json: bool, progress) -> None:
    from hetplan.runtime.distributed.launch import run_pipeline

    result = run_pipeline(plan, opts, timeout_s, progress)
    if result is None:  # a torchrun process other than the last stage's: that one reports
        return
    if as_json:
        click.echo(json.dumps(result.to_json_dict(), sort_keys=True))
        return
    report(result)


def report(r) -> None:
    modes = sorted(set(r.modes))
    where = ", ".join({"cuda": "CUDA GPUs", "emulated": "emulated GPUs (CPU)", "cpu": "CPU only"}[m] for m in modes)
    click.echo(f"ran a pipeline of {len(r.stages)} stages, one process each, on {where}")
    for i, seq in enumerate(r.tokens):
        click.echo(f"sequence {i}: {' '.join(map(str, seq))}")
        if r.text:
            click.echo(f"  text: {r.text[i]!r}")
    click.echo(f"{'':18}{'measured':>13}{'predicted':>13}")
    for key, label in (("ttft_s", "TTFT (warm)"), ("tpot_s", "TPOT"), ("decode_tokens_per_s", "decode tokens/s")):
        m, p = r.measured[key], r.predicted[key]
        fmt = (lambda v: f"{v:.1f}") if key == "decode_tokens_per_s" else format_seconds
        click.echo(f"{label:18}{fmt(m) if m is not None else '-':>13}{fmt(p):>13}")
    click.echo(f"{'stage':8}{'GPU':>5}{'layers':>9}{'busy prefill':>14}{'predicted':>11}{'busy decode':>13}"
               f"{'predicted':>11}{'peak GPU mem':>14}")
    for s in r.stages:
        a, b = s["layers"]
        busy_p = format_seconds(s["busy_prefill_s"]) if s["busy_prefill_s"] is not None else "-"
        busy_d = format_seconds(s["busy_decode_s"]) if s["busy_decode_s"] is not None else "-"
        click.echo(f"{s['rank']:<8}{s['gpu']:>5}{f'{a}-{b - 1}':>9}{busy_p:>14}{format_seconds(s['predicted_ttft_s']):>11}"
                   f"{busy_d:>13}{format_seconds(s['predicted_tpot_s']):>11}"
                   f"{format_bytes(s['peak_bytes'].get('gpu', 0)):>14}")
    if not r.comparable:
        click.echo("times not comparable with the plan: GPUs were emulated on the CPU, so the run measured the CPU")
