"""plan.json's ``pipeline``: the stages of a plan over several GPUs (of one node, or of the
nodes of a cluster), their links and what the whole predicts
(``hetplan.pipeline.PipelinePlan.to_dict`` writes it), and each stage's own single-device plan
(``hetplan.pipeline.record``), made of the plan schema's own pieces. Strict like the rest of the
plan schema; knows nothing about how the stages were chosen.

The pieces come from ``hetplan.schema.plan``, which imports this module after defining them;
this module takes them at its end, so either may be imported first.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from hetplan.schema.fields import Bytes, Count, LinkRate, Seconds, Strict, TokenRate, count, quantity

Name = Annotated[str, Field(max_length=500)]


class StageTiers(Strict):
    gpu: Count = Field(description="blocks resident in this stage's GPU")
    stream: Count = Field(description="blocks streamed to it")
    cpu: Count = Field(description="blocks computed on the CPU")


class StagePlan(Strict):
    """One stage's single-device plan, its layers numbered from 0; the model (its layer range) and
    the workload are the whole plan's."""
    hardware: Hardware = Field(description="the single-device machine the stage was planned on (one GPU of "
                               "its node alone, or its node's CPU)")
    solver: Solver = Field(description="how the stage's plan was found")
    placement: Annotated[list[Placement], Field(min_length=1)] = Field(description="one row per block of the stage")
    staging: Staging = Field(description="the stage's staging buffers")
    memory: Memory = Field(description="bytes the stage uses and may use per tier")
    predicted: Predicted = Field(description="what the stage alone should achieve")
    schedule: Schedule = Field(description="the stage's timeline of each phase")
    cpu_attention_bytes_per_cache_byte: quantity("bytes/byte", 64.0, 1.0) = Field(
        1.0, description="as the plan's key of that name, for this stage")

    @model_validator(mode="after")
    def _tasks_name_its_blocks(self):
        blocks = [p.block for p in self.placement]
        if len(set(blocks)) != len(blocks):
            raise ValueError("placement: a block appears twice")
        for phase in ("prefill", "decode"):
            for t in getattr(self.schedule, phase).tasks:
                if t.block not in blocks:
                    raise ValueError(f"schedule.{phase}: task {t.id!r} belongs to block {t.block!r}, "
                                     f"which the stage's placement does not list")
        return self


class PipelineStage(Strict):
    gpu: count(1023) | None = Field(None, description="index into its node's GPUs (absent: the node's CPU, "
                                    "on a node without a GPU)")
    node: count(1023) | None = Field(None, description="index into the cluster's nodes (absent: 0, the node "
                                     "planned for)")
    device: Name | None = Field(None, description="the GPU's (or CPU's) name")
    layers: Annotated[list[Count], Field(min_length=2, max_length=2)] = Field(description="[first, end) layers")
    ttft_s: Seconds = Field(description="the stage's prefill time")
    tpot_s: Seconds = Field(description="the stage's decode time per token")
    gpu_bytes: Bytes = Field(description="bytes on its GPU")
    cpu_bytes: Bytes = Field(description="bytes of its blocks in DRAM")
    weights: StageTiers = Field(description="its blocks per weights tier")
    plan: StagePlan | None = Field(None, description="the stage's own plan, what its process runs "
                                   "(absent in plans written before it was recorded)")


class LinkLeg(Strict):
    via: Literal["nvlink", "nvswitch", "pcie", "d2h", "h2d", "network"] = Field(
        description="a peer link, a copy out of or into a GPU, or the network between nodes")
    bytes_per_s: LinkRate = Field(description="what it achieves (bandwidth x the link efficiency)")
    latency_s: quantity("s", 1.0) = Field(description="per message")


class PipelineLink(Strict):
    from_gpu: count(1023) | None = Field(None, description="the stage handing on (absent: a CPU stage)")
    to_gpu: count(1023) | None = Field(None, description="the stage receiving (absent: a CPU stage)")
    from_node: count(1023) | None = Field(None, description="its node (absent: 0)")
    to_node: count(1023) | None = Field(None, description="its node (absent: 0)")
    kind: Literal["nvlink", "nvswitch", "pcie", "host", "network"] = Field(
        description="the link between them (network: between two nodes)")
    prefill_s: Seconds = Field(description="the prompt's hidden state across it")
    decode_s: Seconds = Field(description="one token's hidden state across it")
    legs: Annotated[list[LinkLeg], Field(max_length=3)] | None = Field(
        None, description="what it is made of, in turn, each leg taking bytes / bytes_per_s + latency_s (the "
        "simulator restates prefill_s and decode_s from them; absent in plans written before)")


class PipelinePredicted(Strict):
    ttft_s: Seconds = Field(description="every stage's prefill and link in turn")
    tpot_s: Seconds = Field(description="every stage's decode and link in turn")
    latency_s: Seconds = Field(description="ttft + gen_len x tpot")
    decode_tokens_per_s: TokenRate = Field(description="replicas x batch / tpot")
    prefill_tokens_per_s: TokenRate = Field(description="replicas x batch x prompt_len / ttft")
    pipelined_decode_tokens_per_s: TokenRate = Field(
        description="replicas x batch / the slowest stage or link: micro-batches filling every stage")


class PipelineNetwork(Strict):
    name: Name = Field(description="the cluster's name")
    bytes_per_s: LinkRate = Field(description="the network's bandwidth, each way")
    latency_s: quantity("s", 1.0) = Field(description="one message's latency")


class SingleDevice(Strict):
    objective_s: Seconds = Field(description="the best single device's objective seconds (a lower bound "
                                 "when not exact)")
    exact: bool = Field(description="true: a solved plan's; false: a lower bound, too slow to compete")
    pipeline_objective_s: Seconds = Field(description="the pipeline's, in the same seconds (with replicas: "
                                          "one replica's over their number)")


class SplitBaseline(Strict):
    fits: bool = Field(description="false: a stage does not fit with all its layers on its GPU (llama.cpp "
                       "would fail to allocate)")
    tensor_split: Annotated[list[quantity("fraction", 1.0)], Field(max_length=1024)] = Field(
        description="cumulative fractions of free memory per device (llama.cpp's default --tensor-split)")
    stages: Annotated[list[Annotated[list[Count], Field(min_length=3, max_length=3)]], Field(max_length=1024)] = \
        Field(description="[device index, first, end) per stage")
    ttft_s: Seconds | None = Field(None, description="predicted, when it fits")
    tpot_s: Seconds | None = Field(None, description="predicted, when it fits")
    decode_tokens_per_s: TokenRate | None = Field(None, description="batch / tpot")
    prefill_tokens_per_s: TokenRate | None = Field(None, description="batch x prompt_len / ttft")


class ReplicaStep(Strict):
    gpus: count(1023, 1) | None = Field(None, description="replica r's stages on GPU gpu + r x this of the same node")
    nodes: count(1023, 1) | None = Field(None, description="replica r's stages on node node + r x this, the same GPU")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.gpus is None) == (self.nodes is None):
            raise ValueError("give exactly one of gpus and nodes")
        return self


class Pipeline(Strict):
    objective: Literal["sum", "max"] = Field(description="sum (stages in turn) or max (the slowest)")
    stages: Annotated[list[PipelineStage], Field(min_length=1, max_length=1024)] = Field(
        description="contiguous layer ranges, in order")
    links: Annotated[list[PipelineLink], Field(max_length=1023)] = Field(description="between consecutive stages")
    predicted: PipelinePredicted = Field(description="what the pipeline should achieve")
    model: Model | None = Field(None, description="the whole model the stages cut (the plan's own `model` is "
                                "its first stage's layers); absent: the plan's own")
    devices: count(1 << 20) | None = Field(None, description="devices the stages were chosen from")
    replicas: count(1 << 20, 1) | None = Field(None, description="alike groups of devices, each running these "
                                               "stages (the first group's) on sequences of its own; the "
                                               "predicted rates are all of them together (absent: 1)")
    micro_batches: count(1 << 20, 1) | None = Field(
        None, description="micro-batches in flight, each with a KV cache of its own in every stage: the stages' "
        "KV caches (placement kv_bytes) are sized for this many, and `hetplan exec` runs this many by default "
        "(the throughput objective: one per stage; latency: 1; absent: written before, 1 cache)")
    replica_step: ReplicaStep | None = Field(None, description="where replica r runs, with replicas > 1")
    network: PipelineNetwork | None = Field(None, description="between the nodes of a cluster")
    single_device: SingleDevice | None = Field(None, description="the whole model on the best single device")
    baselines: dict[Annotated[str, Field(max_length=100)], SplitBaseline] | None = Field(
        None, description="other engines' splits over the same devices, priced by the same cost model")


# the plan schema's pieces a stage's plan is made of (see the module docstring)
from hetplan.schema.plan import Hardware, Memory, Model, Placement, Predicted, Schedule, Solver, Staging  # noqa: E402,F401

for _model in (StagePlan, PipelineStage, Pipeline):
    _model.model_rebuild()
