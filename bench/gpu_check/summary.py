"""The figures of ``bench/gpu_check.sh``, from the JSON its steps wrote under OUT (steps that
failed are reported as missing)."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None


def gpu_idle_per_step_s(trace: dict, pid: int, steps: int) -> float:
    """Time the GPU lane (thread ``gpu``) sits idle between its first and last task, per step."""
    tid = next((e["tid"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["pid"] == pid
                and e["name"] == "thread_name" and e["args"]["name"] == "gpu"), None)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e["pid"] == pid and e["tid"] == tid)
    if not spans:
        return 0.0
    busy = sum(b - a for a, b in spans)
    return (spans[-1][1] - spans[0][0] - busy) / 1e6 / steps


r, pinned, acc = load("exec.json"), load("pinned.json"), load("accelerate.json")
if r:
    print(f"{'llama-3.1-8b':18}{'measured':>12}{'predicted':>12}{'error':>9}   target |error| <= 15%")
    for k in ("ttft_s", "tpot_s"):
        e = r["relative_error"][k]
        print(f"{k:18}{r['measured'][k] * 1e3:10.2f}ms{r['predicted'][k] * 1e3:10.2f}ms"
              f"{f'{e:+.1%}' if e is not None else 'n/a':>9}")
    print(f"cold TTFT {r['measured']['cold_ttft_s'] * 1e3:.1f} ms (warm {r['measured']['ttft_s'] * 1e3:.1f} ms)")
    gib = 2 ** 30
    print(f"GPU peak allocated {r['peak_bytes']['gpu'] / gib:.2f} GiB, reserved "
          f"{r['peak_bytes'].get('gpu_reserved', 0) / gib:.2f} GiB, plan {r['planned_bytes']['gpu'] / gib:.2f} GiB "
          f"(target: both <= plan)")
    plan = json.loads((out / "plan.json").read_text())
    streamed = sum(p["weight_bytes"] for p in plan["placement"] if "stream" in p["exec"].values())
    print(f"pinned host memory {r['pinned_bytes'] / gib:.2f} GiB for {streamed / gib:.2f} GiB of streamed weights")
    trace = load("trace.json")
    if trace:
        steps = len(r["tokens"][0]) - 1
        print(f"GPU-lane idle per decode step: measured {gpu_idle_per_step_s(trace, 4, steps) * 1e3:.2f} ms, "
              f"plan {gpu_idle_per_step_s(trace, 2, 1) * 1e3:.2f} ms")
    h2d = r.get("h2d_bytes_per_s")
    if h2d and pinned:
        p = pinned["pinned_h2d_bytes_per_s"]
        print(f"streamed loads {h2d / 1e9:.1f} GB/s vs pinned copy {p / 1e9:.1f} GB/s: {h2d / p:.0%} (target >= 80%)")
    if acc:
        ours, theirs = r["measured"]["decode_tokens_per_s"], 1 / acc["tpot_s"]
        print(f"decode tokens/s: hetplan {ours:.2f}, Accelerate {theirs:.2f} ({acc['modules_on_gpu']}/"
              f"{acc['modules']} modules on GPU): ratio {ours / theirs:.2f} (target >= 2)")
runs = {s: load(f"moe-{s}.exec.json") for s in ("ilp", "cpu-moe")}
if all(runs.values()):
    print("mixtral-shaped, 4 layers:")
    for s, m in runs.items():
        e = m["relative_error"]["tpot_s"]
        print(f"  {s:8} TPOT measured {m['measured']['tpot_s'] * 1e3:.2f} ms, predicted "
              f"{m['predicted']['tpot_s'] * 1e3:.2f} ms ({f'{e:+.1%}' if e is not None else 'n/a'}), "
              f"{m['measured']['decode_tokens_per_s']:.2f} tok/s")
    ratio = runs["ilp"]["measured"]["decode_tokens_per_s"] / runs["cpu-moe"]["measured"]["decode_tokens_per_s"]
    print(f"  decode tokens/s ilp / cpu-moe: {ratio:.2f}")
