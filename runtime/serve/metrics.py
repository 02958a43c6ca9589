"""The engine's counters as Prometheus text (``/metrics``), and the histograms behind them.

Gauges: requests running, waiting and swapped out; KV blocks used and held per tier
(``tier="gpu"``/``"cpu"``); generated tokens per second over the last ``RATE_WINDOW_S``.
Counters: requests completed and cancelled, tokens generated, swaps out and in, recomputes,
tokens decoded with attention on the CPU over blocks in DRAM.
Histograms: TTFT (arrival to first token) and TPOT (between consecutive tokens of a request),
in seconds. Knows nothing about HTTP or tensors.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
RATE_WINDOW_S = 10.0


class Histogram:
    """Counts of observations at or below each upper bound (cumulative when rendered), their sum."""

    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one: above every bound
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list:
        out, running = [f"# TYPE {name} histogram"], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return out


class TokenRate:
    """Tokens per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._times = deque()

    def add(self, now: float) -> None:
        self._times.append(now)

    def per_s(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
        return len(self._times) / self.window_s


def render(engine) -> str:
    """The Prometheus text exposition of ``engine``'s state and counters, read while the engine
    steps on (each number is read once; they may be a step apart)."""
    s, sched, alloc = engine.stats, engine.scheduler, engine.pool.alloc
    gauges = {"hetplan_requests_running": len(sched.running), "hetplan_requests_waiting": len(sched.waiting),
              "hetplan_requests_swapped": len(sched.swapped), "hetplan_tokens_per_second": s.rate.per_s()}
    counters = {"hetplan_requests_completed_total": s.completed, "hetplan_requests_cancelled_total": s.cancelled,
                "hetplan_generated_tokens_total": s.tokens, "hetplan_swaps_out_total": sched.swaps_out,
                "hetplan_swaps_in_total": sched.swaps_in, "hetplan_recomputes_total": sched.recomputes,
                "hetplan_cpu_attention_tokens_total": sched.cpu_attention_tokens}
    used = {t: alloc.used_blocks(t) for t in alloc.n_blocks}
    lines = []
    for name, v in gauges.items():
        lines += [f"# TYPE {name} gauge", f"{name} {v}"]
    lines.append("# TYPE hetplan_kv_blocks_used gauge")
    lines += [f'hetplan_kv_blocks_used{{tier="{t}"}} {n}' for t, n in used.items()]
    lines.append("# TYPE hetplan_kv_blocks gauge")
    lines += [f'hetplan_kv_blocks{{tier="{t}"}} {n}' for t, n in alloc.n_blocks.items()]
    for name, v in counters.items():
        lines += [f"# TYPE {name} counter", f"{name} {v}"]
    lines += s.ttft.lines("hetplan_ttft_seconds") + s.tpot.lines("hetplan_tpot_seconds")
    return "\n".join(lines) + "\n"
