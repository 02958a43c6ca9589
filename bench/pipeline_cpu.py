"""A pipeline plan run as four gloo processes on this CPU: each stage's measured busy time
against the plan's predicted stage time, and one micro-batch against one per stage.

    python -W ignore bench/pipeline_cpu.py [--work DIR] [--gen 32] [--prompt 128] [--reps 3] [--micro 1,4]

The machine is described to the planner as it will run: a node of four "GPUs" that are this
CPU, one thread each (every stage process computes with one intra-op thread: the launcher gives
each of the four ``cores // 4``, at least one), whose peaks are measured here first: the fp32
GEMM rate of a 1024x1024x1024 matmul and the streaming read bandwidth of a 256 MiB sum, one
thread, best of 5; efficiencies 1 (the measured rates are achieved rates). Each "GPU" holds
128 MiB, so the 427 MB model needs all four; host links are slow (1 GB/s) so that streaming
does not pay. The model is a Llama of hidden 1024, MLP 2816, 16/4 heads, 8 layers, vocab 8192,
fp32, random weights (``--weights random``: each process makes only its own blocks').

The plan is compiled by ``compile_plan`` (``hetplan compile``) and run by ``run_pipeline``
(``hetplan exec``): one spawned process per stage, gloo between them, emulated GPUs. Busy time
is a stage's own compute (its executor's wall time per pass, not the waits for the other
stages): the timed prefill, and the mean of the decode steps. The run is repeated ``--reps``
times (fresh processes each), and each figure is the median over the runs (a prefill is one
pass per run: on a shared machine one sample is noisy). The ratio is measured / predicted.

Micro-batches (``--micro``, ``hetplan exec --micro-batches``): the same plan run with M groups of
its batch interleaved through the stages, M = 1 (the stages take turns) and M = 4 (one per
stage). For each M, each stage's decode busy and idle seconds (medians), and the
decode rate (M x batch tokens per step over the last stage's decode window) and how many stages
computed at once on average (their decode busy seconds over that window) against the rate the
plan's stage times give M micro-batches (``worker.expected_rate``) and the plan's pipelined rate
(``pipeline.predicted.pipelined_decode_tokens_per_s``: every stage busy). The plan's four
"GPUs" are modelled as four one-thread devices; this machine has fewer cores than that, so the
stages of a pipelined run share them and the pipelined rate is out of reach by construction.

Replicas (``--replicas``): three throughput plans (``--objective throughput``) of the same
model, each run as four processes with one micro-batch per stage: one pipeline over the four
128 MiB "GPUs" of the node above (``plan_pipeline``; the model needs all four), two replicas of a
two-stage pipeline on the same node with 256 MiB "GPUs" (``compile.replicated`` with two
replicas: two hold the model), and what ``compile_plan`` chooses on the 128 MiB node (the
script says what). Each prints its decode rate (every sequence, the replicas' added), each
replica's, and the plan's rates, medians over ``--reps`` runs taken in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024, intermediate_size=2816,
              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=8192,
              max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              torch_dtype="float32", hidden_act="silu")


def measure_peaks() -> dict:
    """One thread: fp32 GEMM FLOP/s (1024^3, best of 5) and read bandwidth (256 MiB sum, best of 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x = torch.randn(64 * 2**20)
    flops, bw = 0.0, 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        flops = max(flops, 2 * 1024**3 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        x.sum()
        bw = max(bw, x.numel() * 4 / (time.perf_counter() - t0))
    torch.set_num_threads(threads)
    return {"flops": flops, "bw": bw}


def node_yaml(peaks: dict, gpu_mib: int = 128) -> str:
    gflops, gbs = peaks["flops"] / 1e9, peaks["bw"] / 1e9
    gpu = (f"  - {{name: this CPU (1 thread), memory: {gpu_mib}MiB, mem_bandwidth: {gbs:.2f}GB/s, "
           f"flops: {{fp32: {gflops:.2f}GFLOPS}}}}\n")
    return (f"name: four-stage-processes\ngpus:\n{gpu * 4}"
            f"cpu: {{name: this CPU, cores: 1, memory: 8GiB, mem_bandwidth: {gbs:.2f}GB/s, "
            f"flops: {{fp32: {gflops:.2f}GFLOPS}}}}\n"
            f"links: {{h2d: 1GB/s, d2h: 1GB/s}}\n"
            f"peers: [{{between: all, kind: pcie, bandwidth: 1GB/s}}]\n"
            f"reserve: {{gpu: 1MiB, cpu: 64MiB}}\n"
            f"efficiency: {{gpu_mem: 1.0, gpu_flops: 1.0, cpu_mem: 1.0, cpu_flops: 1.0, link: 1.0}}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="Where the model config and node.yaml go (default: a temp dir).")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--micro", default="1,4", help="Micro-batch counts to run, comma-separated.")
    ap.add_argument("--replicas", action="store_true", help="Two replicas of two stages against four stages.")
    args = ap.parse_args()
    micro = [int(m) for m in args.micro.split(",")]
    from hetplan.compiler import CompileRequest, compile_plan
    from hetplan.runtime.distributed.launch import run_pipeline
    from hetplan.runtime.session import RunOptions

    work = Path(args.work or tempfile.mkdtemp(prefix="pipeline_cpu_"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(CONFIG))
    peaks = measure_peaks()
    (work / "node.yaml").write_text(node_yaml(peaks))
    print(f"this CPU, one thread: {peaks['flops'] / 1e9:.1f} GFLOP/s fp32 GEMM, {peaks['bw'] / 1e9:.2f} GB/s read")
    if args.replicas:
        replicas_against_stages(work, peaks, args)
        return
    plan, ct = compile_plan(CompileRequest(model=str(work / "model"), hw=str(work / "node.yaml"),
                                           prompt_len=args.prompt, gen_len=args.gen, weight_dtype="fp32"))
    if plan.pipeline is None or len(plan.pipeline["stages"]) != 4:
        raise SystemExit(f"the plan is not a 4-stage pipeline: {plan.pipeline and len(plan.pipeline['stages'])}")
    print(f"compiled in {ct.wall_s:.1f} s: stages "
          + ", ".join(f"layers {s['layers'][0]}-{s['layers'][1] - 1} ({s['weights']['gpu']}/{s['weights']['stream']}/"
                      f"{s['weights']['cpu']} blocks gpu/stream/cpu)" for s in plan.pipeline["stages"]))
    by_m, t0 = {}, time.perf_counter()
    for _ in range(args.reps):   # the counts alternate, so that a change in the machine's load hits each
        for m in micro:
            by_m.setdefault(m, []).append(run_pipeline(plan, RunOptions(weights="random", emulate=True),
                                                       timeout_s=600, micro_batches=m))
    print(f"ran 4 processes (gloo, emulated GPUs, {max(1, (os.cpu_count() or 1) // 4)} thread each) "
          f"{args.reps} times per micro-batch count in {time.perf_counter() - t0:.1f} s; prompt {args.prompt}, "
          f"{args.gen} tokens, batch 1; medians")
    if 1 in by_m:
        stage_table(by_m[1])
    micro_table(by_m)


def replicas_against_stages(work: Path, peaks: dict, args) -> None:
    """One pipeline of four stages, two replicas of two stages, and compile's choice, four
    processes each (module docstring)."""
    import dataclasses

    from hetplan.compiler import CompileRequest, compile_plan, stage_solver
    from hetplan.frontends.resolve import load_model
    from hetplan.hardware import load_node
    from hetplan.pipeline.compile import replicated
    from hetplan.pipeline.plan import plan_pipeline
    from hetplan.pipeline.topology import Topology
    from hetplan.runtime.distributed.launch import run_pipeline
    from hetplan.runtime.session import RunOptions
    from hetplan.workload import Workload

    spec = load_model(str(work / "model"), "fp32")
    plans = {}
    for name, mib in (("1 x 4 stages", 128), ("2 replicas x 2 stages", 256), ("compile's choice", 128)):
        node = work / f"node-{mib}.yaml"
        node.write_text(node_yaml(peaks, mib))
        req = CompileRequest(model=str(work / "model"), hw=str(node), prompt_len=args.prompt, gen_len=args.gen,
                             weight_dtype="fp32", objective="throughput", batch=1)
        topo, solve = Topology.of(load_node(str(node))), stage_solver(req, moe_stages=True)
        if name == "compile's choice":
            plan, _ = compile_plan(req)
        else:
            wl = Workload(1, args.prompt, args.gen, objective="throughput")
            pp = replicated(spec, topo, 2, wl, solve) if mib == 256 else plan_pipeline(spec, topo, wl, solve, "max")
            plan = dataclasses.replace(pp.stages[0].plan, pipeline=pp.to_dict())
        pp = plan.pipeline
        print(f"{name}: {pp.get('replicas') or 1} replica(s) of stages "
              + ", ".join(f"layers {s['layers'][0]}-{s['layers'][1] - 1} ({s['weights']['gpu']}/"
                          f"{s['weights']['stream']}/{s['weights']['cpu']} blocks gpu/stream/cpu)" for s in pp["stages"])
              + f", {pp['micro_batches']} micro-batch(es)")
        plans[name] = plan
    runs: dict = {}
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for name, plan in plans.items():
            runs.setdefault(name, []).append(run_pipeline(plan, RunOptions(weights="random", emulate=True),
                                                          timeout_s=600))
    print(f"ran each {args.reps} times (4 processes, gloo, emulated GPUs) in {time.perf_counter() - t0:.1f} s; "
          f"prompt {args.prompt}, {args.gen} tokens, batch 1 per micro-batch; medians")
    print("| plan | sequences | decode tok/s (all) | per replica | expected for its micro-batches | pipelined (plan) "
          "| per run |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in runs.items():
        rate = statistics.median(r.measured["decode_tokens_per_s"] for r in rs)
        each = [statistics.median(r.replicas[i]["decode_tokens_per_s"] for r in rs) for i in range(len(rs[0].replicas))]
        p = rs[0].predicted
        per_run = " ".join(f"{r.measured['decode_tokens_per_s']:.2f}" for r in rs)
        print(f"| {name} | {len(rs[0].tokens)} | {rate:.2f} | {' / '.join(f'{e:.2f}' for e in each)} | "
              f"{p['micro_batch_decode_tokens_per_s']:.2f} | {p['pipelined_decode_tokens_per_s']:.2f} | {per_run} |")


def stage_table(runs: list) -> None:
    """One micro-batch: each stage's busy time per pass against its predicted time."""
    def med(key, i=None):
        return statistics.median(r.stages[i][key] if i is not None else r.measured[key] for r in runs)

    print("| stage | layers | prefill busy | predicted | ratio | decode busy | predicted | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, s in enumerate(runs[0].stages):
        a, b = s["layers"]
        bp, pp, bd, pd = med("busy_prefill_s", i), s["predicted_ttft_s"], med("busy_decode_s", i), s["predicted_tpot_s"]
        print(f"| {s['rank']} | {a}-{b - 1} | {bp * 1e3:.2f} ms | {pp * 1e3:.2f} ms | {bp / pp:.2f} | "
              f"{bd * 1e3:.2f} ms | {pd * 1e3:.2f} ms | {bd / pd:.2f} |")
    p = runs[0].predicted
    busy_d = sum(med("busy_decode_s", i) for i in range(len(runs[0].stages)))
    print(f"whole pipeline: TTFT {med('ttft_s') * 1e3:.1f} ms (predicted {p['ttft_s'] * 1e3:.1f}), TPOT "
          f"{med('tpot_s') * 1e3:.2f} ms (predicted {p['tpot_s'] * 1e3:.2f}); the stages' decode busy time adds up "
          f"to {busy_d * 1e3:.2f} ms, so {(med('tpot_s') - busy_d) * 1e3:.2f} ms a token is messages and waiting")
    print("per run, prefill busy / predicted by stage: " + "; ".join(
        " ".join(f"{s['busy_prefill_s'] / s['predicted_ttft_s']:.2f}" for s in r.stages) for r in runs))


def micro_table(by_m: dict) -> None:
    """Per micro-batch count: each stage's decode busy and idle time, and the decode rate."""
    print("| micro-batches | stage | decode busy / pass | decode busy | decode idle | busy share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m, runs in by_m.items():
        for i in range(len(runs[0].stages)):
            per = statistics.median(r.stages[i]["busy_decode_s"] for r in runs)
            busy = statistics.median(r.stages[i]["busy_s"]["decode"] for r in runs)
            idle = statistics.median(r.stages[i]["idle_s"]["decode"] for r in runs)
            print(f"| {m} | {i} | {per * 1e3:.2f} ms | {busy:.3f} s | {idle:.3f} s | {busy / (busy + idle):.0%} |")
    print("| micro-batches | decode tok/s | expected for M | ratio | pipelined (plan) | stages busy at once "
          "| per run |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m, runs in by_m.items():
        rate = statistics.median(r.measured["decode_tokens_per_s"] for r in runs)
        p = runs[0].predicted
        each = " ".join(f"{r.measured['decode_tokens_per_s']:.2f}" for r in runs)
        want = p["micro_batch_decode_tokens_per_s"]
        print(f"| {m} | {rate:.2f} | {want:.2f} | {rate / want:.2f} | {p['pipelined_decode_tokens_per_s']:.2f} "
              f"| {statistics.median(busy_at_once(r) for r in runs):.2f} | {each} |")
    if 1 in by_m and len(by_m) > 1:
        base = statistics.median(r.measured["decode_tokens_per_s"] for r in by_m[1])
        print("decode rate against one micro-batch: " + ", ".join(
            f"M = {m}: {statistics.median(r.measured['decode_tokens_per_s'] for r in runs) / base:.2f}x"
            for m, runs in by_m.items() if m != 1))


def busy_at_once(r) -> float:
    """The stages' decode busy seconds together over the last stage's decode window: how many
    stages computed at once, on average (at most the cores they share)."""
    window = r.measured["tpot_s"] * len(r.step_s)
    return sum(s["busy_s"]["decode"] for s in r.stages) / window


if __name__ == "__main__":
    main()
