"""``hetplan export``: a plan -> the closest llama.cpp / Accelerate / vLLM / kTransformers
configuration, with what that engine could not express and its predicted price.

A thin shell over ``hetplan.export``: the configuration goes to ``-o`` (written atomically) or
to stdout; the report (what was not expressed, TTFT/TPOT of the plan and of the export, the
``--strategy`` that re-reads it) to stdout after a written file, else to stderr.
"""

from __future__ import annotations

import shlex

import click

from hetplan.export.result import ENGINES, export, price
from hetplan.files import distinct_targets, writable_target, write_atomic
from hetplan.plan import load_plan
from hetplan.solvers.imported import FILE_ONLY, MAX_INLINE_CHARS
from hetplan.units import format_bytes, format_seconds

_EPILOG = """\b
Examples:
  hetplan export plan.json --to llama.cpp
  hetplan export plan.json --to accelerate -o device_map.json
  hetplan export plan.json --to ktransformers -o rules.yaml
"""


@click.command("export", epilog=_EPILOG)
@click.argument("plan_path", metavar="PLAN.json")
@click.option("--to", "engine", required=True, type=click.Choice(ENGINES), help="The engine to configure.")
@click.option("-o", "--output", default=None, metavar="FILE",
              help="Write the configuration here (atomically) instead of to stdout.")
def command(plan_path, engine, output):
    """Write PLAN.json as ENGINE's configuration, print what ENGINE cannot express of it, and
    price the exported configuration as ENGINE's baseline next to the plan."""
    plan = load_plan(plan_path)
    if output is not None:
        distinct_targets({"-o": output}, {"PLAN": plan_path})
        writable_target(output, "-o")
    exported = export(plan, engine)
    cost = price(plan, exported)
    if output is not None:
        write_atomic(output, exported.text, option="-o")
    else:
        click.echo(exported.text, nl=False)
    for line in report(plan, exported, cost, output):
        click.echo(line, err=output is None)


def report(plan, exported, cost, output) -> list:
    """The lines printed beside an export."""
    p, e = plan.predicted, cost.plan.predicted
    lines = [f"wrote {output}" if output else f"# {exported.engine} configuration above",
             f"plan ({plan.solver['strategy']}): TTFT {format_seconds(p['ttft_s'])}, TPOT {format_seconds(p['tpot_s'])}",
             f"{exported.engine} export: TTFT {format_seconds(e['ttft_s'])} ({e['ttft_s'] / p['ttft_s']:.2f}x), "
             f"TPOT {format_seconds(e['tpot_s'])} ({e['tpot_s'] / p['tpot_s']:.2f}x)"
             + ("" if not cost.missing_bytes else "; does not fit: " + ", ".join(
                 f"{format_bytes(b)} over the {t.upper()} budget" for t, b in cost.missing_bytes.items()))]
    if exported.notes or cost.differences:
        lines.append(f"not expressed by {exported.engine}:")
        lines += [f"  {n}" for n in exported.notes]
        lines += [f"  {d}" for d in cost.differences]
    if exported.usage:
        lines.append("use: " + exported.usage.replace("CONFIG_FILE", repr(str(output or "device_map.json"))))
    name, _, arg = exported.strategy.partition(":")
    if output is None and (len(arg) > MAX_INLINE_CHARS or name in FILE_ONLY):
        lines.append(f"re-read: write it with -o FILE, then hetplan compile MODEL --hw NODE --strategy {name}:FILE")
    else:
        lines.append(f"re-read: hetplan compile MODEL --hw NODE --strategy {shlex.quote(name + ':' + (output or arg))}")
    return lines
