"""The serving plan as text for ``hetplan show``: the engine's sizes and the curve against load,
a table with a bar of throughput per batch (``#`` within the SLOs, ``-`` beyond them, ``x`` where
the KV of that batch does not fit)."""

from __future__ import annotations

from hetplan.units import format_bytes, format_seconds

BAR_WIDTH = 32


def _slo_text(slo: dict) -> str:
    parts = [f"{k.removesuffix('_s').upper()} <= {format_seconds(v)}" for k, v in sorted(slo.items()) if v is not None]
    return ", ".join(parts) or "none"


def serving_section(serving: dict, replicas: int = 1) -> str:
    """``replicas`` > 1: the sizes and the curve are each replica's; the whole serves that many times."""
    s = serving
    each = (f"{replicas} replicas, each with its own engine (the figures below are one replica's; all "
            f"together serve {replicas}x its throughput): " if replicas > 1 else "")
    lines = [f"serving plan (hetplan serve): {each}running batch <= {s['batch']} (of --max-batch {s['max_batch']}), "
             f"context <= {s['max_context']} tokens, SLOs: {_slo_text(s['slo'])}",
             f"  KV pool: blocks of {s['block_tokens']} tokens ({format_bytes(s['block_bytes'])}); "
             f"{s['gpu_blocks']} running, {s['cpu_blocks']} in DRAM for swapped requests",
             "  CPU attention for requests in DRAM: " + (
                 f"on ({format_seconds(s['cpu_attention_s'])} per request per step; up to "
                 f"{s['cpu_attention_requests']} such requests hide behind one GPU step)" if s["cpu_attention"] else
                 "off" + (f" (one request's {format_seconds(s['cpu_attention_s'])} per step would not hide behind "
                          f"the GPU's step)" if s["cpu_attention_s"] is not None else " (no GPU)")),
             "", "  predicted against load (the placement above at each running batch):"]
    top = max(p["throughput_tokens_per_s"] for p in s["curve"])
    chosen_row = max(p["batch"] for p in s["curve"] if p["batch"] <= s["batch"])
    lines.append(f"  {'batch':>5}  {'req/s':>8}  {'tok/s':>9}  {'TTFT':>9}  {'TPOT':>9}  throughput")
    for p in s["curve"]:
        mark = "#" if p["fits"] and p["meets_slo"] else ("-" if p["fits"] else "x")
        bar = mark * max(1, round(BAR_WIDTH * p["throughput_tokens_per_s"] / top)) if top > 0 else ""
        chosen = "  <- chosen" if p["batch"] == chosen_row else ""
        lines.append(f"  {p['batch']:>5}  {p['arrival_rate_per_s']:>8.3g}  {p['throughput_tokens_per_s']:>9.4g}  "
                     f"{format_seconds(p['ttft_s']):>9}  {format_seconds(p['tpot_s']):>9}  {bar}{chosen}")
    lines.append(f"  (# within the SLOs, - beyond them, x: that batch's KV does not fit)")
    return "\n".join(lines) + "\n"
