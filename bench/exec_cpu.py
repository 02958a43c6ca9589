"""hetplan exec vs llama.cpp vs transformers on this CPU: decode TPOT, TTFT, prefill, peak RSS.

    python bench/exec_cpu.py --work /root/.cache/hetplan-bench/exec_cpu [--llama-cpp DIR] [--reps 3]

A Llama-architecture model of 0.85 B parameters (hidden 2048, 16 layers, MLP 5632, 32 query /
8 KV heads, vocab 32000, untied head) with random weights, saved once as safetensors by
transformers (fp32, and a bf16 copy for the bf16 runs) with a placeholder SentencePiece vocabulary (the converter needs one; the
tokens are never decoded). llama.cpp's own ``convert_hf_to_gguf.py`` converts it (f32, bf16)
and its own ``llama-quantize`` makes q8_0, q4_0 and q4_k_m from the f32 file. Per dtype (fp32,
bf16, q8_0, q4_0, q4_k_m) and tool, every measurement is a fresh process, tools rotated in order
from one repetition to the next, median of ``--reps``; 2 threads, batch 1:

- hetplan: an all-CPU plan compiled for this machine (the node.yaml ``hetplan profile`` wrote,
  given as ``--profile``, whose measured table prices the plan; else a CPU-only node of nominal
  peaks), run by ``run_plan`` (``hetplan exec``): prompt 64 + 64 decode tokens (TTFT, TPOT) and
  a 512-token prefill, the plan's predictions beside them. The profile is made by
  ``hetplan profile --out WORK/profile/node.yaml --model WORK/model --weight-dtype bf16
  --weight-dtype q8_0 --weight-dtype q4_0 --weight-dtype q4_k_m``.
- llama.cpp: ``llama-bench -p 64,512 -n 64 -t 2 -r 1`` on the GGUF of that dtype (TPOT = 1 /
  tg64 tokens/s, TTFT = 64 / pp64 tokens/s, prefill = 512 / pp512 tokens/s).
- transformers: ``generate`` on the safetensors checkpoint loaded in that dtype (fp32, bf16;
  it has no GGUF block formats).

Peak RSS is each measured process's own high-water mark, ``VmHWM`` of ``/proc/<pid>/status``:
read inside the Python children when their measurement ends (hetplan: after the prompt-64 run,
before the prefill run's plan is compiled), and polled every 20 ms for ``llama-bench`` (the
last reading before it exits). ``wait4``'s ru_maxrss is not used: a child spawned by this
(large) process starts from the parent's high-water mark. The DRAM streaming read bandwidth is
measured (a 1 GiB torch sum, best of 5) and the bandwidth floor of a decode step is the bytes
of the weights read per token over it. llama.cpp is found by ``--llama-cpp`` or
``$HETPLAN_LLAMA_CPP`` (default: the build under ``/root/.cache/hetplan-bench``); the bench
never builds it, and skips its columns (saying so) when it is absent. The converter runs under
``--convert-python`` (a virtualenv with llama.cpp's ``gguf-py``, transformers and torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CACHE = Path("/root/.cache/hetplan-bench")
CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
DTYPES = ("fp32", "bf16", "q8_0", "q4_0", "q4_k_m")
GGUF = {"fp32": "f32", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0", "q4_k_m": "q4_k_m"}
PROMPT, GEN, PREFILL, THREADS = 64, 64, 512, 2


# -- the model and its GGUF files -----------------------------------------------------------------
def placeholder_vocab(path: Path, n: int) -> None:
    """A SentencePiece model of ``n`` pieces (<unk>, <s>, </s>, 256 bytes, then filler)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = n
    m.trainer_spec.byte_fallback = True
    for i, (piece, kind) in enumerate([("<unk>", 2), ("<s>", 3), ("</s>", 3)]
                                      + [(f"<0x{b:02X}>", 6) for b in range(256)]):
        m.pieces.add(piece=piece, score=0.0, type=kind)
    for i in range(n - len(m.pieces)):
        m.pieces.add(piece=f"\u2581t{i}", score=-float(i), type=1)
    path.write_bytes(m.SerializeToString())


def make_model(work: Path, python: str) -> Path:
    ckpt = work / "model"
    if not (ckpt / "model.safetensors").is_file() and not (ckpt / "model.safetensors.index.json").is_file():
        import torch
        import transformers
        torch.manual_seed(0)
        print(f"writing random weights to {ckpt}", flush=True)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32)
        for p in model.parameters():   # small weights: logits stay finite through 16 layers
            if p.dim() == 2:
                p.data.normal_(0, 0.02)
        model.save_pretrained(ckpt, safe_serialization=True)
    half = work / "model-bf16"                    # hetplan runs a checkpoint in the plan's dtype
    if not (half / "config.json").is_file():
        import torch
        import transformers
        transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).save_pretrained(
            half, safe_serialization=True)
    if not (ckpt / "tokenizer.model").is_file():  # sentencepiece lives in the converter's environment
        subprocess.run([python, __file__, "--child", "vocab", "--work", str(work)], check=True)
    return ckpt


def make_ggufs(work: Path, ckpt: Path, llama: Path, python: str, convert: Path) -> dict:
    out = {}
    for outtype in ("f32", "bf16"):
        f = work / f"model-{outtype}.gguf"
        if not f.is_file():
            print(f"converting to {f.name}", flush=True)
            subprocess.run([python, str(convert), str(ckpt), "--outtype", outtype, "--outfile", str(f)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[outtype] = f
    for q in ("q8_0", "q4_0", "q4_k_m"):
        f = work / f"model-{q}.gguf"
        if not f.is_file():
            print(f"quantising to {f.name}", flush=True)
            subprocess.run([str(llama / "bin" / "llama-quantize"), str(out["f32"]), str(f), q.upper(), str(THREADS)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[q] = f
    return out


# -- one measurement, one process -----------------------------------------------------------------
def peak_rss(pid: int | str = "self") -> int | None:
    """``VmHWM`` (peak resident set) of process ``pid`` in bytes, None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def child(tool: str, dtype: str, work: Path, profile: str | None) -> dict:
    """Runs inside a fresh process: measures one (tool, dtype) and returns its numbers."""
    import torch
    torch.set_num_threads(THREADS)
    ckpt = work / ("model-bf16" if dtype == "bf16" else "model")
    ids = torch.randint(3, CONFIG["vocab_size"], (1, PREFILL), generator=torch.Generator().manual_seed(0))
    if tool == "hetplan":
        from hetplan.compiler import CompileRequest, compile_plan
        from hetplan.runtime.session import RunOptions, run_plan
        node = Path(profile) if profile else work / "node.yaml"   # `hetplan profile`'s node.yaml
        out = {}
        for key, prompt, gen in (("decode", PROMPT, GEN), ("prefill", PREFILL, 1)):
            plan, _ = compile_plan(CompileRequest(model=str(ckpt), hw=str(node), weight_dtype=dtype,
                                                  prompt_len=prompt, gen_len=gen))
            res = run_plan(plan, RunOptions(weights=str(ckpt), prompt_ids=(tuple(ids[0, :prompt].tolist()),),
                                            gen_len=gen))
            out[key] = {"ttft_s": res.measured["ttft_s"], "tpot_s": res.measured.get("tpot_s"),
                        "pred_ttft_s": plan.predicted["ttft_s"], "pred_tpot_s": plan.predicted["tpot_s"],
                        "weight_bytes": sum(p["weight_bytes"] for p in plan.placement), "rss_bytes": peak_rss()}
            del res
        return {"ttft_s": out["decode"]["ttft_s"], "tpot_s": out["decode"]["tpot_s"],
                "rss_bytes": out["decode"]["rss_bytes"],
                "prefill_s": out["prefill"]["ttft_s"], "pred_ttft_s": out["decode"]["pred_ttft_s"],
                "pred_tpot_s": out["decode"]["pred_tpot_s"], "pred_prefill_s": out["prefill"]["pred_ttft_s"],
                "weight_bytes": out["decode"]["weight_bytes"]}
    if tool == "transformers":
        import transformers
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dt).eval()
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        stamps = []

        class Stamp(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids[:, :PROMPT], max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False,
                           logits_processor=transformers.LogitsProcessorList([Stamp()]),
                           attention_mask=torch.ones_like(ids[:, :PROMPT]))
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            t1 = time.perf_counter()
            model(ids)
            prefill = time.perf_counter() - t1
        return {"ttft_s": stamps[0] - t0, "tpot_s": sum(gaps) / len(gaps), "prefill_s": prefill,
                "rss_bytes": peak_rss()}
    raise ValueError(tool)


def measure(tool: str, dtype: str, work: Path, llama: Path, ggufs: dict, profile: str | None) -> dict:
    """One fresh process; its numbers plus its peak RSS."""
    if tool == "llama.cpp":
        out_path = work / "llama-bench.json"
        with open(out_path, "w") as f:
            proc = subprocess.Popen([str(llama / "bin" / "llama-bench"), "-m", str(ggufs[GGUF[dtype]]), "-p",
                                     f"{PROMPT},{PREFILL}", "-n", str(GEN), "-t", str(THREADS), "-r", "1",
                                     "-o", "json"], stdout=f, stderr=subprocess.DEVNULL)
            rss = 0
            while proc.poll() is None:   # VmHWM only grows: the last reading is the peak
                rss = max(rss, peak_rss(proc.pid) or 0)
                time.sleep(0.02)
            status = proc.returncode
        if status:
            raise RuntimeError(f"llama-bench exited {status} on {dtype}")
        rows = json.loads(out_path.read_text())
        ts = {(row["n_prompt"], row["n_gen"]): row["avg_ts"] for row in rows}
        result = {"ttft_s": PROMPT / ts[(PROMPT, 0)], "prefill_s": PREFILL / ts[(PREFILL, 0)],
                  "tpot_s": 1 / ts[(0, GEN)], "rss_bytes": rss}
    else:
        cmd = [sys.executable, "-W", "ignore", __file__, "--child", tool, "--dtype", dtype, "--work", str(work)]
        if profile:
            cmd += ["--profile", profile]
        out_path = work / "child.json"
        with open(out_path, "w") as f:
            status = subprocess.run(cmd, stdout=f, stderr=subprocess.DEVNULL).returncode
        if status:
            raise RuntimeError(f"{tool} exited {status} on {dtype}: rerun {' '.join(cmd)}")
        result = json.loads(out_path.read_text().splitlines()[-1])
    return result


def bandwidth() -> float:
    """DRAM streaming read, bytes/s: a 1 GiB fp32 sum on THREADS threads, best of 5."""
    import torch
    torch.set_num_threads(THREADS)
    buf = torch.ones(2**28)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(5))
    return buf.numel() * 4 / best


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def node_yaml(path: Path) -> None:
    """This machine as a CPU-only node with nominal peaks (used without ``--profile``); the plan
    is all-CPU whatever the peaks."""
    from hetplan.runtime.devices import host_available_bytes
    mem = host_available_bytes() / 2**30
    text = (f"name: this-cpu\ncpu: {{name: host, cores: {THREADS}, memory: {mem:.1f}GiB, mem_bandwidth: 15GB/s, "
            f"flops: {{fp32: 100GFLOPS, bf16: 100GFLOPS}}}}\nreserve: {{cpu: 1GiB}}\n")
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(CACHE / "exec_cpu"), help="model, GGUF files and scratch (kept)")
    ap.add_argument("--llama-cpp", default=os.environ.get("HETPLAN_LLAMA_CPP", str(CACHE / "llama-build")),
                    help="llama.cpp build directory holding bin/llama-bench and bin/llama-quantize")
    ap.add_argument("--llama-src", default=str(CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"),
                    help="llama.cpp source tree (for convert_hf_to_gguf.py)")
    ap.add_argument("--convert-python", default=str(CACHE / "venv" / "bin" / "python"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--profile", default=None,
                    help="the node.yaml `hetplan profile --model WORK/model` wrote: plans are compiled for it "
                         "(priced by its measured table); default a CPU-only node of nominal peaks")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    if args.child == "vocab":
        placeholder_vocab(work / "model" / "tokenizer.model", CONFIG["vocab_size"])
        return
    if args.child:
        print(json.dumps(child(args.child, args.dtype, work, args.profile)))
        return
    work.mkdir(parents=True, exist_ok=True)
    ckpt = make_model(work, args.convert_python)
    node_yaml(work / "node.yaml")
    if args.profile:
        args.profile = str(Path(args.profile).resolve())
    llama = Path(args.llama_cpp)
    have_llama = (llama / "bin" / "llama-bench").is_file()
    ggufs = make_ggufs(work, ckpt, llama, args.convert_python, Path(args.llama_src) / "convert_hf_to_gguf.py") \
        if have_llama else {}
    if not have_llama:
        print(f"llama.cpp not found at {llama} (--llama-cpp / $HETPLAN_LLAMA_CPP): its columns are skipped")
    bw = bandwidth()
    dtypes = args.dtypes.split(",")
    tools = ["hetplan", "llama.cpp", "transformers"] if have_llama else ["hetplan", "transformers"]
    results: dict = {}
    for rep in range(args.reps):
        for i, dtype in enumerate(dtypes):
            k = (rep + i) % len(tools)
            for tool in tools[k:] + tools[:k]:           # order rotated per repetition and dtype
                if tool == "transformers" and dtype not in ("fp32", "bf16"):
                    continue
                r = measure(tool, dtype, work, llama, ggufs, args.profile)
                results.setdefault((dtype, tool), []).append(r)
                print(f"rep {rep + 1} {dtype:7} {tool:12} TPOT {r['tpot_s'] * 1e3:7.1f} ms  TTFT "
                      f"{r['ttft_s'] * 1e3:7.0f} ms  prefill {PREFILL} {r['prefill_s']:6.2f} s  RSS "
                      f"{r['rss_bytes'] / 2**30:5.2f} GiB", flush=True)
    report(results, dtypes, bw)


def report(results: dict, dtypes: list, bw: float) -> None:
    med = lambda dtype, tool, key: statistics.median(r[key] for r in results[(dtype, tool)]) \
        if (dtype, tool) in results else None  # noqa: E731
    print(f"\nDRAM streaming read {bw / 1e9:.1f} GB/s ({THREADS} threads); medians of the repetitions")
    print("| dtype | hetplan TPOT | llama.cpp TPOT | ratio | floor | TPOT / floor | hetplan prefill 512 | llama.cpp "
          "prefill | ratio | transformers TPOT | hetplan TTFT 64 | hetplan RSS | llama.cpp RSS | TPOT pred/meas "
          "| TTFT pred/meas |")
    print("|---|" + "---:|" * 14)
    for dtype in dtypes:
        h, l, t = (lambda key, tool=tool: med(dtype, tool, key) for tool in ("hetplan", "llama.cpp", "transformers"))
        floor = med(dtype, "hetplan", "weight_bytes") / bw
        fmt = lambda v, s="{:.1f}", k=1e3: (s.format(v * k) if v is not None else "-")  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}x" if a is not None and b is not None else "-"  # noqa: E731
        print(f"| {dtype} | {fmt(h('tpot_s'))} ms | {fmt(l('tpot_s'))} ms | {ratio(h('tpot_s'), l('tpot_s'))} | "
              f"{fmt(floor)} ms | {ratio(h('tpot_s'), floor)} | {fmt(h('prefill_s'), '{:.2f}', 1)} s | "
              f"{fmt(l('prefill_s'), '{:.2f}', 1)} s | {ratio(h('prefill_s'), l('prefill_s'))} | "
              f"{fmt(t('tpot_s'))} ms | {fmt(h('ttft_s'), '{:.0f}')} ms | {fmt(h('rss_bytes'), '{:.2f}', 2**-30)} GiB | "
              f"{fmt(l('rss_bytes'), '{:.2f}', 2**-30)} GiB | {ratio(h('pred_tpot_s'), h('tpot_s'))} | "
              f"{ratio(h('pred_ttft_s'), h('ttft_s'))} |")


if __name__ == "__main__":
    main()
