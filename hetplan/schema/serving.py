"""plan.json's ``serving``: what ``hetplan compile --serve`` decided for ``hetplan serve`` (the
running batch, the KV pool per tier, its block size, CPU attention for requests in DRAM) and the
predicted throughput and latency against load (``hetplan.serving`` writes it). With replicas
(``pipeline.replicas`` > 1) every value is one replica's: each runs its own engine with this
batch and these pools, and the whole serves ``replicas`` times the curve's throughput. Strict like
the rest of the plan schema; knows nothing about how the values were chosen.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from hetplan.schema.fields import Bytes, Count, Dim, Seconds, Strict, TokenRate, quantity


class ServingSlo(Strict):
    tpot_s: Seconds | None = Field(description="--slo-tpot (null: none)")
    ttft_s: Seconds | None = Field(description="--slo-ttft (null: none)")


class ServingPoint(Strict):
    batch: Dim = Field(description="running requests")
    ttft_s: Seconds = Field(description="predicted prefill of this batch's prompts together")
    tpot_s: Seconds = Field(description="predicted decode step at this batch")
    decode_tokens_per_s: TokenRate = Field(description="batch / tpot")
    throughput_tokens_per_s: TokenRate = Field(description="batch x gen_len / (ttft + gen_len x tpot)")
    arrival_rate_per_s: quantity("requests/s", 1e12) = Field(
        description="batch / (ttft + gen_len x tpot): the arrival rate that keeps this batch running")
    fits: bool = Field(description="the placement with this batch's KV within both memory budgets")
    meets_slo: bool = Field(description="tpot and ttft within the SLOs")


class Serving(Strict):
    max_batch: Dim = Field(description="--max-batch: the largest running batch considered")
    max_context: Dim = Field(description="--max-context: prompt + max_tokens of a request at most")
    slo: ServingSlo = Field(description="the SLOs the batch was chosen under")
    batch: Dim = Field(description="the running batch chosen (per replica): the most throughput "
                       "within the SLOs, of all replicas together")
    block_tokens: Dim = Field(description="positions per KV block")
    block_bytes: Bytes = Field(description="bytes of one KV block (every layer's K and V)")
    gpu_blocks: Count = Field(description="KV blocks of the running tier (GPU; DRAM on a node without one), "
                             "per replica")
    cpu_blocks: Count = Field(description="KV blocks in DRAM for swapped-out requests, per replica (replicas "
                             "on one node share its DRAM)")
    cpu_attention: bool = Field(description="requests swapped to DRAM keep decoding, attention on the CPU "
                                "beside the GPU's batch")
    cpu_attention_s: Seconds | None = Field(description="one DRAM request's decode attention per step "
                                            "(null without a GPU)")
    cpu_attention_requests: Count = Field(description="DRAM requests whose attention hides behind one GPU step")
    curve: Annotated[list[ServingPoint], Field(min_length=1, max_length=64)] = Field(
        description="the chosen placement at batches 1, 2, 4, ... up to max_batch: one replica's (all "
        "replicas together: pipeline.replicas x its throughput and arrival rate)")
