"""N concurrent requests served by a two-stage pipeline (``hetplan serve`` on a pipeline plan)
against the same model served in one process, on this CPU.

    python -W ignore bench/serve_pipeline.py [--work DIR] [--requests 8] [--prompt 32] [--gen 32] [--reps 3]

The model is a Llama of hidden 1024, MLP 2816, 16/4 heads, 8 layers, vocab 8192, fp32, random
weights (427 MB; ``--weights random``: each process makes only its own blocks'). Two plans of it
are compiled with ``compile_plan`` for an emulated node whose "GPUs" are this CPU: one GPU of
2 GiB (the whole model in one process, ``load_engine``), and two GPUs of 320 MiB (the model
needs both: a pipeline of two stages, ``pipeline.launch.start_engine``: this process is stage 0,
one spawned process stage 1, gloo between them, the cores shared out, one intra-op thread
each). The one-process engine runs with 1 intra-op thread and with 2 (every core; on this
shared machine a second thread can cost more than it gives, its OpenMP barriers waiting for a
thread that another process holds off its core).

Each run submits ``--requests`` requests at once (prompts of ``--prompt`` random ids, each
generating ``--gen`` tokens greedily, ``ignore_eos``) and steps until all are done: tokens/s is
the generated tokens over that window. For the pipeline: each stage's busy seconds (its own
blocks' compute, ``stage_busy_s``) and idle (the window less busy), and how many steps were
issued while another group's step was in flight (``overlapped_steps``). Runs alternate between
the two engines ``--reps`` times (fresh engines each); figures are medians. The machine has two
cores shared with other work, so two stage processes cannot run faster than one process on both
cores: this measures whether the stages overlap, not a speedup.
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


def node_yaml(gpus: int, gpu_mib: int) -> str:
    gpu = f"  - {{name: this CPU, memory: {gpu_mib}MiB, mem_bandwidth: 5GB/s, flops: {{fp32: 50GFLOPS}}}}\n"
    return (f"name: emulated-{gpus}\ngpus:\n{gpu * gpus}"
            f"cpu: {{name: this CPU, cores: 2, memory: 8GiB, mem_bandwidth: 5GB/s, flops: {{fp32: 50GFLOPS}}}}\n"
            f"links: {{h2d: 1GB/s, d2h: 1GB/s}}\n"
            f"peers: [{{between: all, kind: pcie, bandwidth: 1GB/s}}]\n"
            f"reserve: {{gpu: 1MiB, cpu: 64MiB}}\n")


def run(engine, prompts: list, gen: int) -> float:
    """Submit every prompt at once, step until done -> seconds from the first submit to the end."""
    from hetplan.runtime.serve.sampling import SamplingParams

    t0 = time.perf_counter()
    reqs = [engine.submit(p, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    took = time.perf_counter() - t0
    assert all(len(r.generated) == gen for r in reqs)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="Where the model config and node files go (default: a temp dir).")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="Intra-op threads of the one-process engine, comma-separated.")
    args = ap.parse_args()
    from hetplan.compiler import CompileRequest, compile_plan
    from hetplan.runtime.serve.load import load_engine
    from hetplan.runtime.serve.pipeline.launch import start_engine
    from hetplan.runtime.serve.settings import settings_for

    work = Path(args.work or tempfile.mkdtemp(prefix="serve_pipeline_"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(CONFIG))
    plans = {}
    for name, gpus, mib in (("one process", 1, 2048), ("pipeline", 2, 320)):
        (work / f"{name[0]}.yaml").write_text(node_yaml(gpus, mib))
        plans[name] = compile_plan(CompileRequest(model=str(work / "model"), hw=str(work / f"{name[0]}.yaml"),
                                                  prompt_len=args.prompt, gen_len=args.gen, weight_dtype="fp32"))[0]
    pp = plans["pipeline"].pipeline
    if pp is None or len(pp["stages"]) != 2:
        raise SystemExit("the 320 MiB node's plan is not a pipeline of two stages")
    print("pipeline stages: " + ", ".join(f"layers {s['layers'][0]}-{s['layers'][1] - 1} ({s['weights']['gpu']}/"
                                          f"{s['weights']['stream']}/{s['weights']['cpu']} blocks gpu/stream/cpu)"
                                          for s in pp["stages"]))
    blocks = 2 * args.requests * -(-(args.prompt + args.gen) // 16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (args.prompt,), generator=gen).tolist()
               for _ in range(args.requests)]
    counts = [int(t) for t in args.threads.split(",")]
    rows = {**{t: [] for t in counts}, "pipeline": []}
    for _ in range(args.reps):   # the engines alternate, so that a change in the machine's load hits each
        settings = settings_for(plans["one process"], gpu_blocks=blocks, max_batch=args.requests)
        for t in counts:
            torch.set_num_threads(t)
            engine = load_engine(plans["one process"], "random", settings, emulate=True)
            rows[t].append({"s": run(engine, prompts, args.gen)})
            engine.model.close()
        settings = settings_for(plans["pipeline"], gpu_blocks=blocks, max_batch=args.requests)
        engine = start_engine(plans["pipeline"], "random", settings, emulate=True, timeout_s=600)
        took = run(engine, prompts, args.gen)
        engine.stop()
        rows["pipeline"].append({"s": took, "busy": engine.stage_busy_s, "overlapped": engine.overlapped_steps})
    tokens = args.requests * args.gen
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"{args.requests} requests at once, prompt {args.prompt}, {args.gen} tokens each; {args.reps} runs each, "
          f"medians; pipeline: 2 processes, {max(1, (os.cpu_count() or 1) // 2)} thread each")
    print("| engine | window | tokens/s | stage 0 busy / idle | stage 1 busy / idle | steps overlapped |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in counts:
        one = med([r["s"] for r in rows[t]])
        print(f"| one process, {t} thread(s) | {one:.2f} s | {tokens / one:.1f} | | | |")
    p = rows["pipeline"]
    s = med([r["s"] for r in p])
    busy = [med([r["busy"][k] for r in p]) for k in range(2)]
    print(f"| pipeline of 2 | {s:.2f} s | {tokens / s:.1f} | {busy[0]:.2f} / {s - busy[0]:.2f} s | "
          f"{busy[1]:.2f} / {s - busy[1]:.2f} s | {med([r['overlapped'] for r in p]):.0f} |")
    print(f"the stages' busy seconds add up to {(busy[0] + busy[1]) / s:.2f} x the window (1: the stages never "
          f"compute at once; 2: both always do)")


if __name__ == "__main__":
    main()
