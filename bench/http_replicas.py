"""N concurrent HTTP requests served by two replicas (``hetplan serve`` on a plan with
``pipeline.replicas`` = 2: a front and two replica processes) against one process, on this CPU.

    python -W ignore bench/http_replicas.py [--work DIR] [--requests 8] [--prompt 32] [--gen 32] [--reps 2]

The model is ``serve_pipeline``'s Llama (hidden 1024, 8 layers, fp32, random weights, 427 MB;
each process makes its own). Two serving plans of it are compiled (``compile_serving``, as
``compile --serve --max-batch N``) for an emulated node whose "GPUs" are this CPU: one GPU of 2 GiB
(one process), and two alike such GPUs (the planner chooses two replicas of one GPU each). Each
is served by ``hetplan serve --emulate`` as a user starts it; the one-process server runs with
every core (torch's default) and with ``OMP_NUM_THREADS=1``; each replica gets ``cores // 2``
intra-op threads.

Each run posts ``--requests`` requests at once to /v1/completions (prompts of ``--prompt`` random
ids, ``--gen`` greedy tokens each, ``ignore_eos``) after one warm-up request: tokens/s is the
generated tokens over the window from the first post to the last answer. Runs alternate between
the servers ``--reps`` times (a fresh server each); figures are medians. Also printed: the
requests each replica got (``hetplan_replica_requests_total``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_pipeline import CONFIG, node_yaml  # noqa: E402


def start(plan: Path, port: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "hetplan", "serve", str(plan), "--weights", "random", "--emulate",
                             "--port", str(port), "--dist-timeout", "600"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server ended: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def post(port: int, prompt: list, gen: int) -> None:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                   json={"prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == gen, r.text


def window(port: int, prompts: list, gen: int) -> float:
    post(port, prompts[0], 2)   # warm-up
    threads = [threading.Thread(target=post, args=(port, p, gen)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def dealt(port: int) -> list:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return [int(float(v)) for v in re.findall(r'^hetplan_replica_requests_total\{replica="\d+"\} (\S+)$', text, re.M)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="Where the model config, nodes and plans go (default: a temp dir).")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import json

    from hetplan.compiler import CompileRequest
    from hetplan.runtime.serve.api.server import free_port
    from hetplan.serving import ServingRequest, compile_serving

    work = Path(args.work or tempfile.mkdtemp(prefix="http_replicas_"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(CONFIG))
    plans = {}
    for name, gpus in (("one", 1), ("two", 2)):
        (work / f"{name}.yaml").write_text(node_yaml(gpus, 2048))
        plan, _ = compile_serving(CompileRequest(model=str(work / "model"), hw=str(work / f"{name}.yaml"),
                                                 prompt_len=args.prompt, gen_len=args.gen, weight_dtype="fp32"),
                                  ServingRequest(max_batch=args.requests))
        plans[name] = work / f"{name}.json"
        plans[name].write_text(plan.to_json())
        r = (plan.pipeline or {}).get("replicas") or 1
        print(f"{name} GPU(s): {r} replica(s), serving batch {plan.serving['batch']}, "
              f"{plan.serving['gpu_blocks']} GPU blocks each")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (args.prompt,), generator=gen).tolist()
               for _ in range(args.requests)]
    servers = {"one process, every core": (plans["one"], {}),
               "one process, OMP_NUM_THREADS=1": (plans["one"], {"OMP_NUM_THREADS": "1"}),
               "two replicas (front + 2 processes)": (plans["two"], {})}
    rows, shares = {k: [] for k in servers}, []
    for _ in range(args.reps):   # alternating, so that a change in the machine's load hits each
        for name, (plan, extra) in servers.items():
            port = free_port()
            proc = start(plan, port, dict(os.environ, **extra))
            try:
                rows[name].append(window(port, prompts, args.gen))
                if "replicas" in name:
                    shares.append(dealt(port))
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=120)
    tokens = args.requests * args.gen
    print(f"{args.requests} requests at once over HTTP, prompt {args.prompt}, {args.gen} tokens each; {args.reps} "
          f"runs each, medians; {os.cpu_count()} cores")
    print("| server | window | tokens/s |")
    print("| --- | --- | --- |")
    for name, xs in rows.items():
        s = statistics.median(xs)
        print(f"| {name} | {s:.2f} s | {tokens / s:.1f} |")
    print(f"requests dealt to each replica (warm-up included), per run: {shares}")


if __name__ == "__main__":
    main()
