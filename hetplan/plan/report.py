"""Readable text about plans: the ``hetplan show`` summary and the ``--compare`` table.

Reads a Plan's recorded fields (placement, memory, predictions, solver) and formats them; it
computes nothing the plan does not already hold beyond sums and ratios of those numbers.
Knows nothing about solvers or the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.plan import Plan
from hetplan.units import format_bytes, format_percent, format_seconds


def format_table(headers: list, rows: list, right: set = frozenset()) -> str:
    """Columns padded to their widest cell; column indices in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join(line(r) for r in cells)


# -- block table -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockRun:
    """Consecutive layers' blocks of one kind placed identically (or a single block)."""
    first: str
    last: str
    count: int
    weights: str
    prefill: str
    decode: str
    kv: str | None
    experts_on_gpu: int | None
    weight_bytes: float
    kv_bytes: float
    cold_bytes: float = 0.0
    """Of ``weight_bytes``, the cold experts left in DRAM (an MoE run whose weights are ``gpu``)."""

    @property
    def label(self) -> str:
        return self.first if self.count == 1 else f"{self.first}..{self.last}"


def block_runs(plan: Plan) -> list:
    """Compress the placement: blocks of the same kind on consecutive layers with the same
    weights, exec per phase, kv and experts_on_gpu become one run, e.g. ``attn_0..attn_39``.
    Runs are listed in the order of their first block."""
    runs, open_run = [], {}
    for p in plan.placement:
        key = (p["weights"], p["exec"]["prefill"], p["exec"]["decode"], p["kv"], p.get("experts_on_gpu"))
        cur = open_run.get(p["kind"])
        if cur and p["layer"] is not None and cur["layer"] == p["layer"] - 1 and cur["key"] == key:
            cur.update(last=p["block"], layer=p["layer"], count=cur["count"] + 1,
                       weight_bytes=cur["weight_bytes"] + p["weight_bytes"], kv_bytes=cur["kv_bytes"] + p["kv_bytes"],
                       cold_bytes=cur["cold_bytes"] + (p.get("cold_expert_bytes") or 0))
            continue
        cur = {"first": p["block"], "last": p["block"], "layer": p["layer"], "count": 1, "key": key,
               "weight_bytes": p["weight_bytes"], "kv_bytes": p["kv_bytes"],
               "cold_bytes": p.get("cold_expert_bytes") or 0}
        open_run[p["kind"]] = cur
        runs.append(cur)
    return [BlockRun(first=r["first"], last=r["last"], count=r["count"], weights=r["key"][0],
                     prefill=r["key"][1], decode=r["key"][2], kv=r["key"][3], experts_on_gpu=r["key"][4],
                     weight_bytes=r["weight_bytes"], kv_bytes=r["kv_bytes"],
                     cold_bytes=r["cold_bytes"] if r["key"][0] == "gpu" else 0.0) for r in runs]


def block_table(plan: Plan) -> str:
    runs = block_runs(plan)
    moe = any(r.experts_on_gpu is not None for r in runs)
    headers = ["blocks", "n", "weights", "prefill", "decode", "kv", "weight bytes", "kv bytes"]
    if moe:
        headers.append("experts on gpu")
    rows = []
    for r in runs:
        # a resident MoE run's cold experts live in DRAM: the gpu figure counts only what is in HBM
        weight = format_bytes(r.weight_bytes - r.cold_bytes) + (f" + {format_bytes(r.cold_bytes)} cpu"
                                                                 if r.cold_bytes else "")
        row = [r.label, r.count, r.weights, r.prefill, r.decode, r.kv or "-", weight,
               format_bytes(r.kv_bytes) if r.kv else "-"]
        if moe:
            row.append("-" if r.experts_on_gpu is None else r.experts_on_gpu)
        rows.append(row)
    return format_table(headers, rows, right={1, 6, 7, 8})


# -- memory, predictions, solver -------------------------------------------------------------

def memory_table(plan: Plan) -> str:
    m = plan.memory
    parts = sorted({k for t in ("gpu", "cpu") for k in m["breakdown"][t]},
                   key=lambda k: ("weights", "kv", "staging", "workspace").index(k)
                   if k in ("weights", "kv", "staging", "workspace") else 9)
    rows = []
    for t in ("gpu", "cpu"):
        used, budget = m[f"{t}_bytes"], m[f"{t}_budget_bytes"]
        if t == "gpu" and not plan.hardware.gpus:
            continue
        share = f"{100 * used / budget:.1f}%" if budget else "-"
        rows.append([t, format_bytes(used), format_bytes(budget), share] +
                    [format_bytes(m["breakdown"][t][k]) if k in m["breakdown"][t] else "-" for k in parts])
    return format_table(["tier", "used", "budget", "of budget"] + parts, rows, right=set(range(1, 4 + len(parts))))


def busy_fraction(plan: Plan, phase: str, resource: str) -> float:
    """Share of the phase's makespan that ``resource`` spends running tasks."""
    sched = plan.schedule[phase]
    busy_s = sum(t.end_s - t.start_s for t in sched.tasks if t.resource == resource)
    return busy_s / sched.makespan_s if sched.makespan_s > 0 else 0.0


def prediction_table(plan: Plan) -> str:
    p = plan.predicted
    rows = []
    for label, phase, key, bound_key in (("TTFT (prefill)", "prefill", "ttft_s", "lower_bound_ttft_s"),
                                         ("TPOT (decode step)", "decode", "tpot_s", "lower_bound_tpot_s")):
        bound = p.get(bound_key)
        res = p.get("bottleneck", {}).get(phase)
        rows.append([label, format_seconds(p[key]), format_seconds(bound) if bound else "-",
                     f"{p[key] / bound:.2f}x" if bound else "-",
                     f"{res} ({100 * busy_fraction(plan, phase, res):.0f}% busy)" if res else "-"])
    return format_table(["phase", "predicted", "lower bound", "plan / bound", "bottleneck"], rows,
                        right={1, 2, 3})


def rates_lines(plan: Plan) -> list:
    p, wl = plan.predicted, plan.workload
    lines = [f"latency: {format_seconds(p['latency_s'])} (TTFT + {wl.gen_len} x TPOT)",
             f"decode: {p['decode_tokens_per_s']:.2f} tok/s   prefill: {p['prefill_tokens_per_s']:.1f} tok/s   "
             f"end to end: {p['throughput_tokens_per_s']:.2f} tok/s"]
    if p.get("tokens_per_dollar"):
        lines.append(f"tokens per dollar: {p['tokens_per_dollar']:,.0f} "
                     f"(at ${plan.hardware.price_per_hour:g}/hour)")
    return lines


def solver_line(plan: Plan) -> str:
    s = plan.solver
    gap = s.get("mip_gap")
    parts = [f"strategy {s['strategy']}", f"status {s['status']}"]
    if gap is not None:
        parts.append(f"MIP gap {format_percent(gap)}")
    if s.get("lower_bound_s") is not None:
        minimised = "latency" if plan.workload.objective == "throughput" else plan.workload.objective
        parts.append(f"MILP bound on {minimised} {format_seconds(s['lower_bound_s'])}")
    if s.get("incumbent"):
        parts.append(f"kept {s['incumbent']}")
    size = s.get("size")
    if size:
        parts.append(f"{size['binaries']} binaries, {size['constraints']} constraints")
    line = "solver: " + ", ".join(parts)
    if s["status"] not in ("optimal", "heuristic"):
        flag = {"node_limit": "--max-nodes", "time_limit": "--time-limit"}.get(s["status"])
        line += "  (not proven optimal" + (f": raise {flag} and recompile)" if flag else ")")
    return line


def header_lines(plan: Plan) -> list:
    m, wl, hw = plan.model, plan.workload, plan.hardware
    gpu = ", ".join(g.name for g in hw.gpus) or "no GPU"
    st = plan.staging
    staging = (f"staging: {st['depth']} slot(s) x {format_bytes(st['slot_bytes'])}" if st.get("slot_bytes")
               else "staging: none (no block is streamed)")
    return [f"{m.name} ({m.arch}, {m.n_layers} layers, weights {m.weight_dtype}, KV {m.kv_dtype}) "
            f"on {hw.name} ({gpu}; CPU {hw.cpu.name})",
            f"workload: batch {wl.batch}, prompt {wl.prompt_len}"
            + (f" in {wl.n_chunks} chunks of {wl.chunk_len}" if wl.n_chunks > 1 else "")
            + f", generate {wl.gen_len}, objective {wl.objective}",
            solver_line(plan), staging] + (
        [_devices_note(plan)] if plan.pipeline is not None or len(hw.gpus) > 1 else []) + (
        [f"cpu attention: moves {plan.cpu_attention_bytes_per_cache_byte:g} bytes per byte of KV cache it reads "
         f"(the tool this plan follows copies the cache first)"]
        if plan.cpu_attention_bytes_per_cache_byte != 1.0 else [])


def render_show(plan: Plan) -> str:
    """The full ``hetplan show`` text."""
    sections = ["\n".join(header_lines(plan)), "placement\n" + block_table(plan),
                "memory\n" + memory_table(plan), "predicted\n" + prediction_table(plan) + "\n" +
                "\n".join(rates_lines(plan))]
    if plan.pipeline is not None:
        sections.append(pipeline_section(plan))
    return "\n\n".join(sections) + "\n"


def _devices_note(plan: Plan) -> str:
    """What the main part of a plan over several devices is (README, "Several GPUs")."""
    if plan.pipeline is None:
        return (f"note: the placement and schedule below are GPU 0 ({plan.hardware.gpus[0].name}) alone; "
                f"the node's other {len(plan.hardware.gpus) - 1} GPU(s) stay idle")
    s = plan.pipeline["stages"][0]
    return (f"note: the placement and schedule below are the pipeline's first stage ({_device(s)}, layers "
            f"{s['layers'][0]}-{s['layers'][1] - 1}) alone; the pipeline over the devices follows them")


def _device(s: dict) -> str:
    where = f"node {s['node']} " if s.get("node") is not None else ""
    what = f"GPU {s['gpu']}" if s.get("gpu") is not None else "CPU"
    return f"{where}{what}" + (f" ({s['device']})" if s.get("device") else "")


def pipeline_section(plan: Plan) -> str:
    """The stages over several devices, their links, and the pipeline's rates against the best
    single device."""
    pp = plan.pipeline
    rows = [[_device(s), f"{s['layers'][0]}-{s['layers'][1] - 1}",
             "/".join(str(s["weights"][t]) for t in ("gpu", "stream", "cpu")), format_bytes(s["gpu_bytes"]),
             format_seconds(s["ttft_s"]), format_seconds(s["tpot_s"])] for s in pp["stages"]]
    rows += [[f"link {_end(l, 'from')}->{_end(l, 'to')} ({l['kind']})", "", "", "",
              format_seconds(l["prefill_s"]), format_seconds(l["decode_s"])] for l in pp["links"]]
    table = format_table(["stage", "layers", "blocks gpu/stream/cpu", "GPU mem", "TTFT", "TPOT"], rows,
                         right={3, 4, 5})
    p = pp["predicted"]
    of = f" of {pp['devices']} devices" if pp.get("devices") else ""
    net = pp.get("network")
    r = pp.get("replicas") or 1
    n = len(pp["stages"])
    head = (f"{r} replicas, each a pipeline over {n} device{'s' if n > 1 else ''} ({pp.get('devices', r * n)} "
            f"devices in all; the stages below are the first replica's, each replica runs sequences of its own "
            f"and the rates are all of them together; hetplan exec runs every replica)"
            if r > 1 else f"pipeline over {n}{of}")
    lines = [head + (
        f" ({net['name']}: network {net['bytes_per_s'] / 1e9:.3g} GB/s, {net['latency_s'] * 1e6:.0f} us)"
        if net else "") + " (plan.json's 'pipeline': the plan hetplan exec runs, one process per stage)", table,
             f"  TTFT {format_seconds(p['ttft_s'])}, TPOT {format_seconds(p['tpot_s'])}: decode "
             f"{p['decode_tokens_per_s']:.2f} tok/s, prefill {p['prefill_tokens_per_s']:.1f} tok/s; with "
             f"micro-batches in every stage {p['pipelined_decode_tokens_per_s']:.2f} tok/s"]
    one = pp.get("single_device")
    if one is not None:
        ratio = one["objective_s"] / one["pipeline_objective_s"]
        lines.append(f"  against the best single device: {ratio:.2f}x" if one["exact"] else
                     f"  against any single device: at least {ratio:.2f}x (its lower bound)")
    for name, b in sorted(pp.get("baselines", {}).items()):
        lines.append(f"  {name}: " + (f"decode {b['decode_tokens_per_s']:.2f} tok/s, TTFT "
                                      f"{format_seconds(b['ttft_s'])} (the pipeline "
                                      f"{p['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x its decode)"
                                      if b.get("fits") else "does not fit"))
    return "\n".join(lines)


def _end(l: dict, end: str) -> str:
    node = l.get(f"{end}_node")
    gpu = l.get(f"{end}_gpu")
    return (f"{node}." if node is not None else "") + (str(gpu) if gpu is not None else "cpu")


# -- compare table ---------------------------------------------------------------------------

def compare_table(rows: list, objective: str) -> str:
    """The ``--compare`` table from ``hetplan.plan.compare.compare_dicts`` rows (chosen plan first),
    each baseline with the tool version it follows."""
    out = []
    for r in rows:
        fit = "yes" if r["fits"] else "no: " + ", ".join(f"{t.upper()} short {format_bytes(b)}"
                                                         for t, b in r["missing_bytes"].items())
        ratio = r["ratio_to_chosen"]
        out.append([r["strategy"] + (" (chosen)" if r["chosen"] else ""), format_seconds(r["ttft_s"]),
                    format_seconds(r["tpot_s"]), f"{r['decode_tokens_per_s']:.2f}", format_bytes(r["gpu_bytes"]),
                    format_bytes(r["cpu_bytes"]), fit, "-" if ratio is None else f"{ratio:.2f}x",
                    r.get("follows", "-")])
    ratio_head = "x chosen (1/tok/s)" if objective == "throughput" else f"x chosen ({objective})"
    return format_table(["strategy", "TTFT", "TPOT", "decode tok/s", "GPU mem", "CPU mem", "fits?", ratio_head,
                         "follows"], out, right={1, 2, 3, 4, 5, 7})
