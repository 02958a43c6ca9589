"""The serving plan: the static part of ``hetplan serve`` decided once at compile time.

``decide`` compiles the model at running batches 1, 2, 4, ... up to ``--max-batch`` with the same
cost model and solver as any plan, keeps the placement with the most throughput whose predicted
TPOT and TTFT meet the SLOs, and sizes the engine around it (``pools``: KV pool per tier, block
size, CPU attention for requests whose cache is in DRAM); ``curve`` replays that one placement at
every batch to predict throughput and latency against load; ``report`` draws the curve as text.
What it writes is plan.json's ``serving`` (``hetplan.schema.serving``). Pure: knows nothing about
torch, HTTP or the engine that reads it.
"""

from hetplan.serving.decide import ServingRequest, compile_serving

__all__ = ["ServingRequest", "compile_serving"]
