"""``hetplan compile``: MODEL + NODE -> plan.json."""

from __future__ import annotations

import click

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.plan import write_atomic


@click.command("compile")
@click.argument("model")
@click.option("--hw", "hw", required=True, help="Node preset name or node.yaml path.")
@click.option("-o", "--output", default="plan.json", show_default=True, help="Where to write the plan.")
@click.option("--strategy", default="ilp", show_default=True, help="ilp | all-gpu | greedy | ngl[:N] | stream")
@click.option("--objective", default="latency", show_default=True,
              type=click.Choice(["latency", "ttft", "tpot", "throughput"]))
@click.option("--batch", default=1, show_default=True, type=int)
@click.option("--prompt-len", default=512, show_default=True, type=int)
@click.option("--gen-len", default=128, show_default=True, type=int)
@click.option("--weight-dtype", default="auto", show_default=True)
@click.option("--kv-dtype", default=None)
@click.option("--gpu-mem", default=None)
@click.option("--cpu-mem", default=None)
def command(model, hw, output, strategy, objective, batch, prompt_len, gen_len, weight_dtype, kv_dtype,
            gpu_mem, cpu_mem):
    """Plan MODEL (a preset, a config.json or a directory holding one) on NODE."""
    req = CompileRequest(model=model, hw=hw, batch=batch, prompt_len=prompt_len, gen_len=gen_len,
                         objective=objective, strategy=strategy, weight_dtype=weight_dtype,
                         kv_dtype=kv_dtype, gpu_mem=gpu_mem, cpu_mem=cpu_mem)
    plan, secs = compile_plan(req)
    for note in req.notes:
        click.echo(f"note: {note}", err=True)
    write_atomic(output, plan.to_json())
    p = plan.predicted
    click.echo(f"wrote {output}: TTFT {p['ttft_s']:.4f} s, TPOT {p['tpot_s']:.4f} s "
               f"({plan.solver['strategy']}, {plan.solver['status']}, {secs:.2f} s)")
