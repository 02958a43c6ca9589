"""hetplan exec vs transformers generate on this CPU: decode time per token, side by side.

A Llama-architecture model of about 0.5 B parameters (hidden 1536, 16 layers, MLP 4096, 12
query / 4 KV heads, vocab 32000; fp32, the dtype this CPU decodes fastest in both) with random
weights, written once by transformers' ``save_pretrained``. hetplan compiles an all-CPU plan for
this machine and executes it from that checkpoint; transformers loads the same checkpoint and
calls ``generate`` (greedy, ``use_cache=True``). Same process, same ``torch.get_num_threads()``,
batch 1, 64 new tokens; the two alternate for ``--rounds`` rounds and the medians are compared.
TPOT is the mean time between consecutive tokens (hetplan: its measured decode steps;
transformers: a logits processor stamping every step); the median single step is printed too,
as the estimate least disturbed by other processes on a shared machine.

    python bench/exec_cpu.py [--rounds 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.devices import host_available_bytes
from hetplan.runtime.session import RunOptions, run_plan

CONFIG = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
PROMPT_LEN, GEN_LEN = 16, 64


def node_yaml(path: Path) -> None:
    """This machine as a CPU-only node (the planner's numbers only shape the plan, here all-CPU)."""
    mem_gib = host_available_bytes() / 2**30
    path.write_text(f"name: this-cpu\ncpu: {{name: host, cores: {torch.get_num_threads()}, memory: {mem_gib:.1f}GiB, "
                    f"mem_bandwidth: 10GB/s, flops: {{fp32: 100GFLOPS}}}}\nreserve: {{cpu: 1GiB}}\n")


class _Stamp(transformers.LogitsProcessor):
    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_tpot_s(model, ids) -> tuple[float, float, list]:
    """(TTFT, TPOT, step times) of transformers' greedy generate."""
    stamp = _Stamp()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=GEN_LEN, do_sample=False, use_cache=True,
                       logits_processor=transformers.LogitsProcessorList([stamp]),
                       attention_mask=torch.ones_like(ids))
    gaps = [b - a for a, b in zip(stamp.times, stamp.times[1:])]
    return stamp.times[0] - t0, sum(gaps) / len(gaps), gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", default=None, help="Directory for the checkpoint (kept); default: a temp dir.")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="hetplan-bench-"))
    ckpt = work / "model"
    if not (ckpt / "config.json").is_file():
        torch.manual_seed(0)
        print(f"writing random weights to {ckpt} ...", flush=True)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32)
        model.save_pretrained(ckpt, safe_serialization=True)
        del model
    node_yaml(work / "node.yaml")
    plan, _ = compile_plan(CompileRequest(model=str(ckpt), hw=str(work / "node.yaml"), strategy="ilp",
                                          weight_dtype="fp32", prompt_len=PROMPT_LEN, gen_len=GEN_LEN))
    assert all(p["weights"] == "cpu" for p in plan.placement)
    params = sum(p["weight_bytes"] for p in plan.placement) / 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    opts = RunOptions(weights=str(ckpt), prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN)
    print(f"model: llama {params / 1e9:.2f} B params fp32, batch 1, prompt {PROMPT_LEN}, {GEN_LEN} new tokens, "
          f"{torch.get_num_threads()} threads")
    run_plan(plan, opts)  # warm-up: page the checkpoint in, first-call kernel setup
    hf_tpot_s(hf, ids)
    ours, theirs = [], []
    for r in range(args.rounds):
        res = run_plan(plan, opts)
        ours.append((res.measured["ttft_s"], res.measured["tpot_s"], list(res.step_s)))
        theirs.append(hf_tpot_s(hf, ids))
        print(f"round {r + 1}: hetplan TPOT {ours[-1][1] * 1e3:7.1f} ms   transformers TPOT "
              f"{theirs[-1][1] * 1e3:7.1f} ms   ratio {ours[-1][1] / theirs[-1][1]:.3f}", flush=True)
    rows = [("TTFT (ms)", [o[0] for o in ours], [t[0] for t in theirs]),
            ("TPOT (ms)", [o[1] for o in ours], [t[1] for t in theirs]),
            ("median step (ms)", [s for o in ours for s in o[2]], [s for t in theirs for s in t[2]])]
    print(f"{'medians':18}{'hetplan':>10}{'transformers':>14}{'ratio':>8}")
    for label, a, b in rows:
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{label:18}{ma * 1e3:10.1f}{mb * 1e3:14.1f}{ma / mb:8.3f}")
    tpot_ratio = statistics.median(o[1] for o in ours) / statistics.median(t[1] for t in theirs)
    print(f"TPOT ratio hetplan/transformers = {tpot_ratio:.3f} (target <= 1.0)")


if __name__ == "__main__":
    main()
