"""hetplan serve vs llama-server under load on this CPU: throughput and TTFT/TPOT p50/p99 against
the arrival rate; then an emulated GPU with a small budget, to show the KV pool swapping.

    python bench/serve_load.py [--work DIR] [--rates 0.1,0.2,0.4] [--requests 10] [--slots 4]

The model: Llama architecture, 0.45 B parameters (hidden 1280, 20 layers, MLP 3584, 20 query /
4 KV heads of 64, vocab 32000, untied head), random weights (std 0.02) saved by transformers in
bf16 with ``bench/exec_cpu.py``'s placeholder SentencePiece vocabulary, converted once by
llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` (fp32: torch's CPU matmuls in bf16 are
slower than in fp32 on this machine; the values are the bf16 ones, exactly). Both servers load
that one GGUF file:

- hetplan: ``hetplan compile model.gguf --hw node.yaml --serve --max-batch SLOTS --max-context C``
  for this machine as an all-CPU node (``exec_cpu.node_yaml``), then ``hetplan serve plan.json
  --weights model.gguf``;
- llama.cpp: ``llama-server -m model.gguf -t 2 -tb 2 --parallel SLOTS -c SLOTS*(C+16)`` (16 positions
  of slack per slot), plus ``--llama-args`` (``--poll 0``: its threads sleep instead of spinning
  while they wait for work, which matters on a machine shared with other work).

The workload, the same trace for both servers at each rate: ``--requests`` requests, prompt
lengths uniform on [8, 40] tokens (random ids), output lengths uniform on [8, 24] tokens
(``ignore_eos``, greedy, so each request generates exactly its length), arrivals a Poisson
process at the rate (exponential gaps, seeded per rate). Every request streams
(``/v1/completions``, ``stream: true``); TTFT is send to first text chunk, TPOT the request's
(last chunk - first chunk) / (tokens - 1), throughput the generated tokens of completed requests
over first send to last completion. p50 and p99 are over requests (with 10 requests p99 is
about the slowest). A rate is bounded by ``--time-limit`` seconds: requests not done by then are
cancelled and not counted as completed. Loopback only (127.0.0.1); servers run one at a time,
with OMP/torch threads = 2.

The emulated-GPU run (``--emulate-requests``; 0 skips it): the same model planned with
``--gpu-mem`` set so the KV pool holds three full contexts (12 blocks of 16 tokens) while four
requests run, served with ``--emulate`` (the GPU tier is a CPU device with the plan's budget
enforced); all requests arrive at once, each generating until its context is full (64 tokens),
and the server's ``/metrics`` counters say what was sent, completed, preempted (swapped out,
recomputed) and swapped back in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exec_cpu  # noqa: E402  (the placeholder vocabulary, the node.yaml, the cache's paths)

CONFIG = dict(hidden_size=1280, intermediate_size=3584, num_hidden_layers=20, num_attention_heads=20,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
PROMPT_RANGE, OUTPUT_RANGE = (8, 40), (8, 24)
CONTEXT = PROMPT_RANGE[1] + OUTPUT_RANGE[1]
THREADS = 2


# -- the model ------------------------------------------------------------------------------------
def make_gguf(work: Path, convert_python: str, convert: Path) -> Path:
    """The random bf16 checkpoint under ``work/model`` (with exec_cpu's placeholder vocabulary)
    and its GGUF, each made once."""
    ckpt = work / "model"
    if not (ckpt / "model.safetensors").is_file():
        import torch
        import transformers
        torch.manual_seed(0)
        print(f"writing random weights to {ckpt}", flush=True)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32)
        for p in model.parameters():   # small weights: logits stay finite through 20 layers
            if p.dim() == 2:
                p.data.normal_(0, 0.02)
        model.to(torch.bfloat16).save_pretrained(ckpt, safe_serialization=True)
    if not (ckpt / "tokenizer.model").is_file():  # sentencepiece lives in the converter's environment
        subprocess.run([convert_python, exec_cpu.__file__, "--child", "vocab", "--work", str(work)], check=True)
    gguf = work / "model-f32.gguf"
    if not gguf.is_file():
        print(f"converting to {gguf.name}", flush=True)
        subprocess.run([convert_python, str(convert), str(ckpt), "--outtype", "f32", "--outfile", str(gguf)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return gguf


# -- the workload ---------------------------------------------------------------------------------
def trace(rate: float, n: int, seed: int) -> list:
    """[(arrival s, prompt ids, output tokens)]: Poisson arrivals at ``rate``, lengths uniform."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        prompt = [rng.randrange(3, CONFIG["vocab_size"]) for _ in range(rng.randint(*PROMPT_RANGE))]
        out.append((t, prompt, rng.randint(*OUTPUT_RANGE)))
    return out


async def one_request(client, url: str, t0: float, arrival: float, prompt: list, n_out: int) -> dict:
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    sent = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0.0, "ignore_eos": True, "stream": True}
    first = last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"sent": sent, "ok": False, "error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"sent": sent, "ok": False, "error": str(chunk["error"])}
                now = time.perf_counter()
                if chunk["choices"][0].get("text"):
                    first = first or now
                last = now
    except asyncio.CancelledError:
        return {"sent": sent, "ok": False, "error": "time limit"}
    if first is None:
        return {"sent": sent, "ok": False, "error": "no text"}
    return {"sent": sent, "ok": True, "tokens": n_out, "ttft_s": first - sent, "done": last,
            "tpot_s": (last - first) / max(1, n_out - 1)}


async def run_load(url: str, requests: list, time_limit_s: float) -> list:
    import httpx
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit_s + 60), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one_request(client, url, t0, *r)) for r in requests]
        done, pending = await asyncio.wait(tasks, timeout=time_limit_s)
        for t in pending:
            t.cancel()
        results = [await t if t in done else {"ok": False, "error": "time limit", "sent": None} for t in tasks]
        for t in pending:
            try:
                await t
            except BaseException:
                pass
    return results


def pct(values: list, q: float) -> float:
    """The q-quantile (0..1) of ``values``, linear between order statistics."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarise(results: list) -> dict:
    ok = [r for r in results if r["ok"]]
    sent = [r["sent"] for r in results if r.get("sent") is not None]
    span = (max(r["done"] for r in ok) - min(sent)) if ok else float("nan")
    ttft, tpot = [r["ttft_s"] for r in ok], [r["tpot_s"] for r in ok]
    return {"sent": len(results), "completed": len(ok), "tokens": sum(r["tokens"] for r in ok),
            "throughput_tokens_per_s": sum(r["tokens"] for r in ok) / span if ok else 0.0,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "tpot_p50_s": pct(tpot, 0.5), "tpot_p99_s": pct(tpot, 0.99),
            "errors": sorted({r["error"] for r in results if not r["ok"]})}


# -- the servers ----------------------------------------------------------------------------------
def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))


def start(cmd: list, log: Path, url: str, timeout_s: float = 600) -> subprocess.Popen:
    import httpx
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"{cmd[0]} did not answer /health in {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metrics(url: str) -> dict:
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("hetplan_") and "{" not in line and " " in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def hetplan(*args) -> None:
    subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], check=True, env=env())


# -- the runs -------------------------------------------------------------------------------------
def load_runs(args, work: Path, gguf: Path, llama: Path) -> dict:
    node = work / "node.yaml"
    exec_cpu.node_yaml(node)
    plan = work / "serve-plan.json"
    hetplan("compile", gguf, "--hw", node, "--serve", "--max-batch", args.slots, "--max-context", CONTEXT,
            "--prompt-len", sum(PROMPT_RANGE) // 2, "--gen-len", sum(OUTPUT_RANGE) // 2, "-o", plan)
    servers = {
        "hetplan": [sys.executable, "-m", "hetplan", "serve", str(plan), "--weights", str(gguf),
                    "--port", str(args.port)],
        "llama-server": [str(llama / "bin" / "llama-server"), "-m", str(gguf), "-t", str(THREADS), "-tb",
                         str(THREADS), "--parallel", str(args.slots), "-c", str(args.slots * (CONTEXT + 16)),
                         "--host", "127.0.0.1", "--port", str(args.port), *args.llama_args.split()],
    }
    servers = {k: v for k, v in servers.items() if k in args.servers.split(",")}
    if not (llama / "bin" / "llama-server").is_file():
        print(f"llama-server not found under {llama}: its rows are skipped")
        servers.pop("llama-server")
    url = f"http://127.0.0.1:{args.port}"
    rates = [float(r) for r in args.rates.split(",")]
    results = {}
    for name, cmd in servers.items():
        proc = start(cmd, work / f"{name}.log", url)
        try:
            asyncio.run(run_load(url, trace(rates[0], 2, seed=99), 120))   # warm-up, not counted
            for i, rate in enumerate(rates):
                res = summarise(asyncio.run(run_load(url, trace(rate, args.requests, seed=i), args.time_limit)))
                results[(name, rate)] = res
                print(f"{name:12} rate {rate:5.2f}/s: {res['completed']}/{res['sent']} done, "
                      f"{res['throughput_tokens_per_s']:6.2f} tok/s, TTFT p50 {res['ttft_p50_s']:6.2f} s p99 "
                      f"{res['ttft_p99_s']:6.2f} s, TPOT p50 {res['tpot_p50_s'] * 1e3:6.0f} ms p99 "
                      f"{res['tpot_p99_s'] * 1e3:6.0f} ms {res['errors'] or ''}", flush=True)
        finally:
            stop(proc)
    return results


def emulated_run(args, work: Path, gguf: Path) -> dict:
    """A GPU budget of the weights plus about two requests' KV: the pool must swap."""
    node = work / "gpu-node.yaml"
    node.write_text("name: emulated-gpu\ngpus: [{name: emulated, memory: 4GiB, mem_bandwidth: 100GB/s, "
                    "flops: {bf16: 10TFLOPS, fp32: 10TFLOPS}}]\ncpu: {name: host, cores: 2, memory: 16GiB, "
                    "mem_bandwidth: 15GB/s, flops: {fp32: 100GFLOPS, bf16: 100GFLOPS}}\n"
                    "links: {h2d: 10GB/s, d2h: 10GB/s}\nreserve: {gpu: 1KiB, cpu: 1GiB}\n")
    plan = work / "serve-plan-emulated.json"
    hetplan("compile", gguf, "--hw", node, "--serve", "--max-batch", args.slots, "--max-context", CONTEXT,
            "--prompt-len", sum(PROMPT_RANGE) // 2, "--gen-len", sum(OUTPUT_RANGE) // 2, "--gpu-mem",
            args.gpu_mem, "-o", plan)
    serving = json.loads(plan.read_text())["serving"]
    url = f"http://127.0.0.1:{args.port}"
    proc = start([sys.executable, "-m", "hetplan", "serve", str(plan), "--weights", str(gguf), "--emulate",
                  "--port", str(args.port)], work / "hetplan-emulated.log", url)
    try:
        # every request fills its context: four running ones need 16 blocks, more than the GPU holds
        burst = [(0.0, p, CONTEXT - len(p)) for _, p, _ in trace(0.0, args.emulate_requests, seed=7)]
        res = summarise(asyncio.run(run_load(url, burst, args.time_limit)))
        m = metrics(url)
    finally:
        stop(proc)
    out = {"gpu_blocks": serving["gpu_blocks"], "cpu_blocks": serving["cpu_blocks"],
           "block_tokens": serving["block_tokens"], "batch": serving["batch"], **res,
           "server_completed": m.get("hetplan_requests_completed_total"),
           "swaps_out": m.get("hetplan_swaps_out_total"), "swaps_in": m.get("hetplan_swaps_in_total"),
           "recomputes": m.get("hetplan_recomputes_total"),
           "cpu_attention_tokens": m.get("hetplan_cpu_attention_tokens_total")}
    print("emulated GPU: " + json.dumps(out), flush=True)
    return out


def report(results: dict, emulated: dict | None) -> None:
    print("\n| server | rate (req/s) | completed | throughput (tok/s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, rate), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {name} | {rate:g} | {r['completed']}/{r['sent']} | {r['throughput_tokens_per_s']:.2f} | "
              f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['tpot_p50_s'] * 1e3:.0f} / "
              f"{r['tpot_p99_s'] * 1e3:.0f} |")
    rates = sorted({rate for _, rate in results})
    for rate in rates:
        h, l = results.get(("hetplan", rate)), results.get(("llama-server", rate))
        if h and l and l["throughput_tokens_per_s"] > 0:
            print(f"rate {rate:g}: hetplan / llama-server throughput {h['throughput_tokens_per_s'] / l['throughput_tokens_per_s']:.2f}x, "
                  f"p99 TPOT {h['tpot_p99_s'] / l['tpot_p99_s']:.2f}x")
    if emulated:
        e = emulated
        print(f"\nemulated GPU ({e['gpu_blocks']} GPU blocks of {e['block_tokens']} tokens, {e['cpu_blocks']} in DRAM, "
              f"batch <= {e['batch']}): sent {e['sent']}, completed {e['completed']} (server counted "
              f"{e['server_completed']:.0f}), swapped out {e['swaps_out']:.0f}, swapped in {e['swaps_in']:.0f}, "
              f"recomputed {e['recomputes']:.0f}, tokens decoded with CPU attention {e['cpu_attention_tokens']:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(exec_cpu.CACHE / "serve_load"), help="model, GGUF, plans, logs (kept)")
    ap.add_argument("--llama-cpp", default=os.environ.get("HETPLAN_LLAMA_CPP", str(exec_cpu.CACHE / "llama-build")))
    ap.add_argument("--llama-src", default=str(exec_cpu.CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"))
    ap.add_argument("--convert-python", default=str(exec_cpu.CACHE / "venv" / "bin" / "python"))
    ap.add_argument("--rates", default="0.1,0.2,0.4", help="arrival rates, requests/s")
    ap.add_argument("--requests", type=int, default=10, help="requests per rate")
    ap.add_argument("--slots", type=int, default=4, help="hetplan --max-batch and llama-server --parallel")
    ap.add_argument("--time-limit", type=float, default=300, help="seconds per rate at most")
    ap.add_argument("--emulate-requests", type=int, default=8, help="requests of the emulated-GPU run (0: none)")
    ap.add_argument("--gpu-mem", default="1672MiB", help="the emulated GPU's budget")
    ap.add_argument("--skip-load", action="store_true", help="only the emulated-GPU run")
    ap.add_argument("--servers", default="hetplan,llama-server", help="which servers the load runs drive")
    ap.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--poll 0'")
    ap.add_argument("--port", type=int, default=18431)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf = make_gguf(work, args.convert_python, Path(args.llama_src) / "convert_hf_to_gguf.py")
    results = {} if args.skip_load else load_runs(args, work, gguf, Path(args.llama_cpp))
    emulated = emulated_run(args, work, gguf) if args.emulate_requests else None
    report(results, emulated)


if __name__ == "__main__":
    main()
