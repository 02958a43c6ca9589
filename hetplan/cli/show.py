"""``hetplan show``: explain a plan file; optionally draw its timeline or write a trace."""

from __future__ import annotations

import click

from hetplan.files import distinct_targets
from hetplan.pipeline.record import replicas_of
from hetplan.plan import load_plan
from hetplan.plan.report import render_show
from hetplan.plan.timeline import write_timeline, write_trace
from hetplan.progress import step

_EPILOG = """\b
Examples:
  hetplan show plan.json
  hetplan show plan.json --timeline plan.svg
  hetplan show plan.json --trace plan.trace.json   # open in ui.perfetto.dev or chrome://tracing
"""


@click.command("show", epilog=_EPILOG)
@click.argument("plan_path", metavar="PLAN.json")
@click.option("--timeline", default=None, metavar="FILE.svg|FILE.png",
              help="Draw the predicted schedule as a Gantt chart: one row per resource, a panel per "
                   "phase. SVG needs nothing; PNG needs matplotlib.")
@click.option("--trace", default=None, metavar="FILE.json",
              help="Write the predicted schedule as a Chrome/Perfetto trace (a process per phase, a "
                   "thread per resource, microseconds).")
def command(plan_path, timeline, trace):
    """Print a readable summary of PLAN.json: placement per block (identical consecutive layers
    merged), memory per tier against its budget, predicted TTFT/TPOT beside their lower bounds,
    the bottleneck resource per phase, and the solver's status and gap; for a serving plan
    (``compile --serve``), the engine's sizes and throughput/latency against load."""
    distinct_targets({"--timeline": timeline, "--trace": trace}, {"PLAN": plan_path})
    plan = load_plan(plan_path)
    click.echo(render_show(plan), nl=False)
    if plan.serving is not None:
        from hetplan.serving.report import serving_section
        click.echo("\n" + serving_section(plan.serving, replicas_of(plan)), nl=False)
    if timeline:
        with step(f"drawing the timeline {timeline}"):
            write_timeline(plan, timeline)
        click.echo(f"\nwrote timeline {timeline}")
    if trace:
        with step(f"writing the trace {trace}"):
            write_trace(plan, trace)
        click.echo(f"wrote trace {trace}")
