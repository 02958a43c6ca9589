"""plan.json's ``pipeline``: the stages of a plan over several GPUs, their links and what the
whole predicts (``hetplan.pipeline.PipelinePlan.to_dict`` writes it). Strict like the rest of
the plan schema; knows nothing about how the stages were chosen.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from hetplan.schema.fields import Bytes, Count, Seconds, Strict, TokenRate, count


class StageTiers(Strict):
    gpu: Count = Field(description="blocks resident in this stage's GPU")
    stream: Count = Field(description="blocks streamed to it")
    cpu: Count = Field(description="blocks computed on the CPU")


class PipelineStage(Strict):
    gpu: count(1023) = Field(description="index into hardware.gpus")
    layers: Annotated[list[Count], Field(min_length=2, max_length=2)] = Field(description="[first, end) layers")
    ttft_s: Seconds = Field(description="the stage's prefill time")
    tpot_s: Seconds = Field(description="the stage's decode time per token")
    gpu_bytes: Bytes = Field(description="bytes on its GPU")
    cpu_bytes: Bytes = Field(description="bytes of its blocks in DRAM")
    weights: StageTiers = Field(description="its blocks per weights tier")


class PipelineLink(Strict):
    from_gpu: count(1023) = Field(description="the stage handing on")
    to_gpu: count(1023) = Field(description="the stage receiving")
    kind: Literal["nvlink", "nvswitch", "pcie", "host"] = Field(description="the link between them")
    prefill_s: Seconds = Field(description="the prompt's hidden state across it")
    decode_s: Seconds = Field(description="one token's hidden state across it")


class PipelinePredicted(Strict):
    ttft_s: Seconds = Field(description="every stage's prefill and link in turn")
    tpot_s: Seconds = Field(description="every stage's decode and link in turn")
    latency_s: Seconds = Field(description="ttft + gen_len x tpot")
    decode_tokens_per_s: TokenRate = Field(description="batch / tpot")
    prefill_tokens_per_s: TokenRate = Field(description="batch x prompt_len / ttft")
    pipelined_decode_tokens_per_s: TokenRate = Field(
        description="batch / the slowest stage or link: micro-batches filling every stage")


class Pipeline(Strict):
    objective: Literal["sum", "max"] = Field(description="sum (stages in turn) or max (the slowest)")
    stages: Annotated[list[PipelineStage], Field(min_length=1, max_length=1024)] = Field(
        description="contiguous layer ranges, in order")
    links: Annotated[list[PipelineLink], Field(max_length=1023)] = Field(description="between consecutive stages")
    predicted: PipelinePredicted = Field(description="what the pipeline should achieve")
