"""``hetplan check``: recompile plans from their recorded inputs; exit 1 on a regression (for CI)."""

from __future__ import annotations

import click

from hetplan.errors import HetplanError
from hetplan.plan.check import check_plan, plan_paths
from hetplan.progress import step

_EPILOG = """\b
Examples:
  hetplan check plans/                      # every plans/*.json; exit 1 on a regression
  hetplan check plan.json --tolerance 0.05  # allow predictions 5% worse
  hetplan check plans/ --update             # accept today's plans (rewrites the files)
"""


@click.command("check", epilog=_EPILOG)
@click.argument("paths", nargs=-1, required=True, metavar="PLAN.json... | DIR")
@click.option("--tolerance", default=0.01, show_default=True, type=float, metavar="FRACTION",
              help="Relative worsening of a predicted time (ttft_s, tpot_s, latency_s) that still "
                   "passes: 0.01 = 1%.")
@click.option("--allow-placement-change", is_flag=True,
              help="Report a changed placement (weights, exec, kv, staging depth, batch, dtype) "
                   "without failing.")
@click.option("--update", is_flag=True,
              help="Rewrite each plan (atomically) with the recompiled one instead of comparing.")
def command(paths, tolerance, allow_placement_change, update):
    """Recompile each plan from its recorded inputs (inputs.cli_args) and compare it with the file.

    Prints one OK line per plan that passes. A plan fails when a predicted time got worse than
    the tolerance, it no longer fits in memory, or its placement changed; the command then prints
    what differs and exits with status 1."""
    if not 0 <= tolerance < float("inf"):  # also refuses nan
        raise HetplanError(f"--tolerance: must be a finite fraction >= 0 (0.01 = 1%), got {tolerance}")
    counts = {"OK": 0, "UPDATED": 0, "FAIL": 0, "ERROR": 0}
    for path in plan_paths(paths):
        try:
            with step(f"checking {path}"):
                res = check_plan(path, tolerance=tolerance, allow_placement_change=allow_placement_change,
                                 update=update)
        except HetplanError as e:  # unreadable plan: report it and check the others
            counts["ERROR"] += 1
            click.echo(f"ERROR {path}: {e}")
            continue
        verb = ("UPDATED" if res.updated else "OK") if res.ok else "FAIL"
        counts[verb] += 1
        click.echo(f"{verb} {res.path}: {res.summary}" if res.ok else f"FAIL {res.path}")
        for line in res.failures:
            click.echo(f"  - {line}")
        for line in res.notes:
            click.echo(f"  note: {line}")
    tally = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    if counts["ERROR"]:  # the worst outcome wins: unreadable plans (2) over regressions (1)
        click.echo(f"hetplan: error: {counts['ERROR']} plan(s) could not be checked (ERROR above; {tally}); "
                   f"fix or recompile them", err=True)
        raise click.exceptions.Exit(2)
    if counts["FAIL"]:
        hint = "" if update else "; if the change is intended, run `hetplan check --update` and commit the plans"
        click.echo(f"{counts['FAIL']} plan(s) failed ({tally}){hint}", err=True)
        raise click.exceptions.Exit(1)
