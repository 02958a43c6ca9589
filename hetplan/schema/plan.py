"""The plan.json schema: every key a plan holds, its type, its unit (in the key's name) and its
physical range, as ``show``, ``check`` and ``exec`` read it.

Strict at every depth: an unknown key is refused with the accepted keys listed, an enumerated
value (a tier, a device, a resource, a task kind) must be one of its names, and every number must
be physically possible (``hetplan.schema.fields``). Cross-references are checked too: every
edge joins two tasks of its phase, every task and placement row names a block of the plan.
Knows nothing about how a plan is made; ``hetplan.plan.format`` validates with it and builds the
Plan.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from hetplan.dtypes import BITS_PER_ELEMENT
from hetplan.model import FAMILIES
from hetplan.plan.format import RESOURCES, SCHEMA_VERSION, TIERS, WEIGHTS
from hetplan.schema.fields import (MAX_NODES_MAX, TIME_LIMIT_MAX_S, Bytes, Count, Dim, Fingerprint, FlopRate,
                                   Fraction, LinkRate, MemRate, Seconds, Strict, TokenRate, count, quantity)
from hetplan.schema.config import RopeScaling
from hetplan.schema.serving import Serving, ServingPoint, ServingSlo
from hetplan.schema.routing import Routing
from hetplan.workload import OBJECTIVES

Name = Annotated[str, Field(max_length=500)]
Dtype = Literal[tuple(BITS_PER_ELEMENT)]
Family = Literal[FAMILIES]
Weights = Literal[WEIGHTS]
Tier = Literal[TIERS]
Resource = Literal[RESOURCES]
TaskKind = Literal["embed", "attn_in", "attn_core", "attn_out", "attn", "mlp", "moe", "moe_route", "moe_experts",
                   "moe_cold", "moe_merge", "head", "load", "act_up", "act_down", "kv_down"]
"""Stage kinds (``attn``: an ONNX import's attention, one stage per block) and transfers."""
BlockKind = Literal["embed", "attn", "mlp", "moe", "head"]
Objective = Literal[OBJECTIVES]


# -- model ---------------------------------------------------------------------------------------

class GgufRecord(Strict):
    """What a model read from a .gguf file records about the file (``hetplan.frontends.gguf``)."""
    file_bytes: dict[Name, Annotated[int, Field(ge=0, le=2**50)]] = Field(description="the file's bytes per block")
    types: dict[Name, Annotated[int, Field(ge=0, le=10**7)]] = Field(description="tensor count per GGUF type")
    tensors: Annotated[str, Field(pattern=r"^[0-9a-f]{16,64}$")] = Field(description="digest of the tensor list")


class ModelExtra(Strict):
    """Family-specific settings the runtime reads (deepseek routing, qwen3_moe normalisation, the
    source of an ONNX or GGUF import)."""
    gguf: GgufRecord | None = Field(None, description="set for a model read from a .gguf file")
    norm_topk_prob: bool | None = Field(None, description="renormalise the top-k routing weights")
    n_group: Count | None = Field(None, description="deepseek: expert groups")
    topk_group: Count | None = Field(None, description="deepseek: groups a token may choose")
    routed_scaling_factor: quantity("x", 1e6) | None = Field(None, description="deepseek")
    topk_method: Name | None = Field(None, description="deepseek")
    scoring_func: Name | None = Field(None, description="deepseek: softmax or sigmoid")
    rope_interleave: bool | None = Field(None, description="deepseek")
    source: Literal["onnx"] | None = Field(None, description="set for a model imported from an .onnx file")
    onnx_path: Annotated[str, Field(max_length=4096)] | None = Field(None, description="the .onnx file")
    onnx_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(None, description="its hash")
    with_past: bool | None = Field(None, description="the export takes past key/values")
    opset: count(1000, 1) | None = Field(None, description="the export's ONNX opset")
    native_dtype: Dtype | None = Field(None, description="the dtype of the export's weights")


class Model(Strict):
    name: Name = Field(description="preset name or the config's _name_or_path")
    arch: Family = Field(description="model family")
    fingerprint: Fingerprint | None = Field(None, description="sha256 of the shape-determining fields")
    n_layers: Dim = Field(description="decoder layers")
    hidden: Dim = Field(description="hidden size")
    intermediate: Count = Field(description="dense MLP width")
    n_heads: Dim = Field(description="attention heads")
    n_kv_heads: Dim = Field(description="key/value heads")
    head_dim: Dim = Field(description="width of one head")
    vocab: Dim = Field(description="vocabulary size")
    max_positions: Dim = Field(description="longest context")
    tie_embeddings: bool = Field(False, description="head shares the embedding's weights")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="normalisation")
    norm_eps: quantity("x", 1.0, low_open=True) = Field(1e-6, description="normalisation epsilon")
    act: Name = Field("silu", description="MLP activation (the runtime runs silu, swish, relu, gelu, "
                      "gelu_new, gelu_pytorch_tanh)")
    gated_mlp: bool = Field(True, description="gate+up+down (SwiGLU) or up+down")
    pos: Literal["rope", "learned"] = Field("rope", description="position encoding")
    rope_theta: quantity("x", 1e12, low_open=True) = Field(10000.0, description="RoPE base")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling (Hugging Face keys)")
    attn_bias: bool = Field(False, description="bias on q/k/v")
    attn_out_bias: bool = Field(False, description="bias on the attention output")
    mlp_bias: bool = Field(False, description="bias in the MLP")
    qk_norm: bool = Field(False, description="per-head RMSNorm on q and k")
    n_experts: Count = Field(0, description="routed experts per MoE layer (0: dense)")
    experts_per_token: Count = Field(0, description="experts each token chooses")
    moe_intermediate: Count = Field(0, description="width of one expert")
    n_shared_experts: Count = Field(0, description="always-chosen experts")
    first_dense_layers: Count = Field(0, description="leading layers with a dense MLP")
    q_lora_rank: Count = Field(0, description="MLA query rank (0: none)")
    kv_lora_rank: Count = Field(0, description="MLA key/value rank (0: standard attention)")
    qk_rope_head_dim: Count = Field(0, description="MLA rotary part of a head")
    qk_nope_head_dim: Count = Field(0, description="MLA non-rotary part of a head")
    v_head_dim: Count = Field(0, description="MLA value head width")
    weight_dtype: Dtype = Field("fp16", description="how weights are stored")
    kv_dtype: Dtype = Field("fp16", description="how the KV cache is stored")
    extra: ModelExtra = Field(default_factory=ModelExtra, description="family-specific settings")
    block_bytes: dict[Name, Annotated[int, Field(ge=0, le=2**50)]] | None = Field(
        None, description="weight bytes per block as held, where the file's tensor types set them (GGUF)")


# -- hardware ------------------------------------------------------------------------------------

class DeviceFlops(Strict):
    fp32: FlopRate | None = Field(None, description="peak fp32 rate")
    tf32: FlopRate | None = Field(None, description="peak tf32 rate")
    fp16: FlopRate | None = Field(None, description="peak fp16 rate")
    bf16: FlopRate | None = Field(None, description="peak bf16 rate")
    fp8: FlopRate | None = Field(None, description="peak fp8 rate")
    int8: FlopRate | None = Field(None, description="peak int8 rate")


class Device(Strict):
    name: Name = Field(description="shown in reports")
    memory_bytes: Annotated[int, Field(ge=1, le=2**50)] = Field(description="total memory")
    mem_bytes_per_s: MemRate = Field(description="memory bandwidth")
    flops_per_s: DeviceFlops = Field(description="peak rates by dtype")
    cores: count(100000) = Field(0, description="cores or SMs")
    device_class: Literal["", "consumer", "datacenter", "desktop", "server"] = Field(
        "", description="the class whose default constants the node took")
    numa: count(63) | None = Field(None, description="CPU socket of a GPU (written when stated)")


class PeerLink(Strict):
    a: count(1023) = Field(description="index of one GPU")
    b: count(1023) = Field(description="index of the other GPU")
    kind: Literal["nvlink", "nvswitch", "pcie", "host"] = Field(description="how they exchange activations")
    bytes_per_s: LinkRate | None = Field(None, description="one direction's bandwidth (None: through host)")


class HwEfficiency(Strict):
    gpu_mem: Fraction = Field(description="achieved / peak HBM bandwidth")
    cpu_mem: Fraction = Field(description="achieved / peak DRAM bandwidth")
    link: Fraction = Field(description="achieved / stated link bandwidth")
    gpu_flops: Fraction = Field(description="achieved / peak GPU FLOP/s")
    cpu_flops: Fraction = Field(description="achieved / peak CPU FLOP/s")


class HwLatency(Strict):
    gpu_task: quantity("s", 1.0) = Field(description="fixed cost of one GPU task")
    cpu_task: quantity("s", 1.0) = Field(description="fixed cost of one CPU task")
    link_task: quantity("s", 1.0) = Field(description="fixed cost of one copy")


class Hardware(Strict):
    name: Name = Field(description="the node's name")
    gpus: Annotated[list[Device], Field(max_length=1024)] = Field(description="plans use the first")
    cpu: Device = Field(description="the host")
    h2d_bytes_per_s: LinkRate = Field(description="host-to-device bandwidth")
    d2h_bytes_per_s: LinkRate = Field(description="device-to-host bandwidth")
    gpu_reserve_bytes: Annotated[int, Field(ge=0, le=2**50)] = Field(description="GPU memory kept free")
    cpu_reserve_bytes: Annotated[int, Field(ge=0, le=2**50)] = Field(description="DRAM kept free")
    efficiency: HwEfficiency = Field(description="achieved fraction of each peak")
    latency_s: HwLatency = Field(description="per-task fixed costs")
    price_per_hour: quantity("$/h", 10000.0, low_open=True) | None = Field(None, description="machine cost")
    profile: Annotated[str, Field(max_length=4096)] | None = Field(None, description="node.profile.json path")
    peers: Annotated[list[PeerLink], Field(max_length=2**19)] | None = Field(
        None, description="GPU-to-GPU links (written for a node with several GPUs)")


# -- what was decided and predicted -----------------------------------------------------------

class Workload(Strict):
    batch: Dim = Field(description="sequences decoded together")
    prompt_len: Dim = Field(description="prompt tokens per sequence")
    gen_len: Dim = Field(description="generated tokens per sequence")
    objective: Objective = Field(description="what the plan minimises")
    prefill_chunk: Dim | None = Field(None, description="prompt tokens per prefill chunk")


class SolverOptions(Strict):
    time_limit_s: quantity("s", TIME_LIMIT_MAX_S, low_open=True) | None = Field(None, description="--time-limit")
    max_nodes: count(MAX_NODES_MAX, 1) | None = Field(None, description="--max-nodes")
    mip_rel_gap: quantity("fraction", 1.0) | None = Field(None, description="--mip-gap")
    depths: list[count(64, 1)] | None = Field(None, description="staging depths tried")


class SolverSize(Strict):
    binaries: count(10**9) = Field(description="binary variables of the MILP")
    constraints: count(10**9) = Field(description="constraints of the MILP")


class Solver(Strict):
    strategy: Name = Field(description="ilp or a baseline (ngl:N, ...)")
    status: Name = Field(description="optimal, heuristic, time_limit, node_limit, interrupted")
    mip_gap: quantity("fraction", 1e9) | None = Field(None, description="relative gap to the bound")
    lower_bound_s: Seconds | None = Field(None, description="proven bound on the objective")
    milp_objective_s: Seconds | None = Field(None, description="the MILP's own objective")
    objective_s: Seconds = Field(description="the replayed objective")
    incumbent: Name | None = Field(None, description="set when a baseline replayed better")
    options: SolverOptions = Field(default_factory=SolverOptions, description="solver settings")
    size: SolverSize | None = Field(None, description="size of the MILP")
    formulation: Literal["chain-dp", "chain-dp+milp"] | None = Field(
        None, description="set when the chain DP decided some configuration (with MILPs for the rest: +milp)")


class BlockExec(Strict):
    prefill: Weights = Field(description="where the block runs in prefill")
    decode: Weights = Field(description="where the block runs in decode")


class Placement(Strict):
    block: Name = Field(description="block name (embed, attn_3, ...)")
    kind: BlockKind = Field(description="block kind")
    layer: Count | None = Field(description="layer index (none for embed, head)")
    weights: Weights = Field(description="gpu, cpu or stream")
    exec: BlockExec = Field(description="device per phase")
    kv: Tier | None = Field(description="where an attention block's KV cache lives")
    experts_on_gpu: Count | None = Field(description="MoE: routed experts resident in HBM")
    gpu_experts: list[Count] | None = Field(None, description="MoE: which ones")
    cold_expert_bytes: Bytes | None = Field(None, description="MoE: bytes of the experts left in DRAM")
    weight_bytes: Bytes = Field(description="weights of the block")
    kv_bytes: Bytes = Field(description="KV cache of the block")

    @model_validator(mode="after")
    def _fields_of_its_kind(self):
        if (self.kv is None) != (self.kind != "attn"):
            raise ValueError(f"block {self.block!r} ({self.kind}): 'kv' is set for attention blocks only "
                             f"(gpu or cpu), null for the others")
        if self.kind != "moe" and (self.experts_on_gpu is not None or self.gpu_experts is not None):
            raise ValueError(f"block {self.block!r} ({self.kind}): experts are recorded for MoE blocks only")
        if (self.layer is None) != (self.kind in ("embed", "head")):
            raise ValueError(f"block {self.block!r} ({self.kind}): 'layer' is null for embed and head only")
        return self


class Staging(Strict):
    depth: count(64, 1) = Field(description="staging-buffer slots")
    slot_bytes: Bytes = Field(description="bytes of one slot")


class GpuBreakdown(Strict):
    weights: Bytes = Field(description="resident weights")
    kv: Bytes = Field(description="KV cache")
    staging: Bytes = Field(description="staging slots")
    workspace: Bytes = Field(description="activations")
    copies_out: Bytes = Field(description="values waiting in HBM for their copies to the host, at most at once")


class CpuBreakdown(Strict):
    weights: Bytes = Field(description="weights in DRAM")
    kv: Bytes = Field(description="KV cache")
    workspace: Bytes = Field(description="activations")


class Breakdown(Strict):
    gpu: GpuBreakdown = Field(description="GPU bytes by use")
    cpu: CpuBreakdown = Field(description="CPU bytes by use")


class Memory(Strict):
    gpu_bytes: Bytes = Field(description="GPU memory the plan uses")
    gpu_budget_bytes: Bytes = Field(description="GPU memory it may use")
    cpu_bytes: Bytes = Field(description="DRAM the plan uses")
    cpu_budget_bytes: Bytes = Field(description="DRAM it may use")
    breakdown: Breakdown = Field(description="bytes by tier and use")


class Bottleneck(Strict):
    prefill: Resource = Field(description="busiest resource in prefill")
    decode: Resource = Field(description="busiest resource in decode")


class Predicted(Strict):
    ttft_s: Seconds = Field(description="time to first token")
    tpot_s: Seconds = Field(description="time per output token")
    latency_s: Seconds = Field(description="ttft + gen_len x tpot")
    decode_tokens_per_s: TokenRate = Field(description="decode throughput")
    prefill_tokens_per_s: TokenRate = Field(description="prefill throughput")
    throughput_tokens_per_s: TokenRate = Field(description="tokens generated per second overall")
    lower_bound_ttft_s: Seconds = Field(description="no placement has a lower TTFT")
    lower_bound_tpot_s: Seconds = Field(description="no placement has a lower TPOT")
    bottleneck: Bottleneck = Field(description="busiest resource per phase")
    tokens_per_dollar: quantity("tokens/$", 1e15) | None = Field(None, description="with a price")


class Task(Strict):
    id: Name = Field(description="unique in its phase")
    resource: Resource = Field(description="the queue it runs on")
    block: Name = Field(description="the block it belongs to")
    kind: TaskKind = Field(description="stage or transfer kind")
    duration_s: Seconds = Field(description="how long it runs")
    start_s: Seconds = Field(0.0, description="when it starts")
    end_s: Seconds = Field(0.0, description="when it ends")
    bytes: Bytes = Field(0.0, description="bytes it moves or reads")
    flops: quantity("FLOP", 1e24) = Field(0.0, description="work it does")
    slot: count(64) | None = Field(None, description="staging slot of a load")
    cost_source: Literal["analytic", "profile"] = Field("analytic", description="where duration_s came from")

    @model_validator(mode="after")
    def _ends_after_it_starts(self):
        if self.end_s < self.start_s:
            raise ValueError(f"task {self.id!r} ends ({self.end_s:g} s) before it starts ({self.start_s:g} s)")
        return self


class PhaseSchedule(Strict):
    tasks: list[Task] = Field(description="tasks in queue order")
    edges: list[Annotated[list[Name], Field(min_length=2, max_length=2)]] = Field(description="(source id, destination id) dependencies")

    @model_validator(mode="after")
    def _edges_join_tasks(self):
        ids = {t.id for t in self.tasks}
        if len(ids) != len(self.tasks):
            raise ValueError("two tasks share an id")
        for src, dst in self.edges:
            if src not in ids or dst not in ids:
                raise ValueError(f"edge ({src!r}, {dst!r}) names a task that is not in this phase")
        return self


class Schedule(Strict):
    prefill: PhaseSchedule = Field(description="the prompt's tasks")
    decode: PhaseSchedule = Field(description="one decode step's tasks")


class CliArgs(Strict):
    """The compile request, so that ``hetplan check`` can recompile the plan."""
    model: Name | None = Field(description="the model argument")
    hw: Name | None = Field(description="--hw")
    batch: Dim = Field(description="--batch")
    prompt_len: Dim = Field(description="--prompt-len")
    gen_len: Dim = Field(description="--gen-len")
    objective: Objective = Field(description="--objective")
    strategy: Name = Field(description="--strategy")
    weight_dtype: Literal[("auto",) + tuple(BITS_PER_ELEMENT)] = Field(description="--weight-dtype")
    kv_dtype: Dtype | None = Field(description="--kv-dtype")
    gpu_mem: Name | None = Field(description="--gpu-mem")
    cpu_mem: Name | None = Field(description="--cpu-mem")
    time_limit_s: quantity("s", TIME_LIMIT_MAX_S, low_open=True) = Field(description="--time-limit")
    max_nodes: count(MAX_NODES_MAX, 1) = Field(description="--max-nodes")
    mip_gap: quantity("fraction", 1.0) | None = Field(None, description="--mip-gap (absent: 1e-4)")
    stream_cold_experts: bool | None = Field(None, description="--stream-cold-experts")
    prefill_chunk: Dim | None = Field(None, description="--prefill-chunk")
    routing: Routing | None = Field(None, description="the --routing statistics, recorded whole")


class Inputs(Strict):
    model_source: Name | None = Field(None, description="the model as given")
    hw_source: Name | None = Field(None, description="the node as given")
    cli_args: CliArgs | None = Field(None, description="the compile request")


# after the pieces a stage's own plan is made of (pipeline.stages[].plan)
from hetplan.schema.pipeline import (LinkLeg, Pipeline, PipelineLink, PipelineNetwork,  # noqa: E402
                                     PipelinePredicted, PipelineStage, ReplicaStep, SingleDevice, SplitBaseline,
                                     StagePlan, StageTiers)


class PlanFile(Strict):
    schema_version: Literal[SCHEMA_VERSION] = Field(description="format version")
    digest: Fingerprint | None = Field(None, description="sha256 of the rest (detects edits)")
    model: Model = Field(description="the model planned")
    hardware: Hardware = Field(description="the node planned for")
    workload: Workload = Field(description="the request")
    solver: Solver = Field(description="how the plan was found")
    placement: Annotated[list[Placement], Field(min_length=1)] = Field(description="one row per block")
    staging: Staging = Field(description="staging buffers for streamed weights")
    memory: Memory = Field(description="bytes used and allowed per tier")
    predicted: Predicted = Field(description="what the plan should achieve")
    schedule: Schedule = Field(description="the timeline of each phase")
    inputs: Inputs = Field(default_factory=Inputs, description="what it was compiled from")
    cpu_attention_bytes_per_cache_byte: quantity("bytes/byte", 64.0, 1.0) = Field(
        1.0, description="DRAM bytes a CPU decode attention moves per KV byte read (written when not 1)")
    pipeline: Pipeline | None = Field(None, description="the stages over several GPUs (written for a node "
                                      "with several, or a cluster): the plan to run; the rest of the file is "
                                      "its first stage's own plan")
    serving: Serving | None = Field(None, description="what `compile --serve` decided for `hetplan serve`")

    @model_validator(mode="after")
    def _blocks_agree(self):
        blocks = [p.block for p in self.placement]
        if len(set(blocks)) != len(blocks):
            raise ValueError("placement: a block appears twice")
        known = set(blocks)
        for phase in ("prefill", "decode"):
            for t in getattr(self.schedule, phase).tasks:
                if t.block not in known:
                    raise ValueError(f"schedule.{phase}: task {t.id!r} belongs to block {t.block!r}, "
                                     f"which the placement does not list")
        return self


SECTIONS = (("", PlanFile), ("model", Model), ("model.rope_scaling", RopeScaling), ("model.extra", ModelExtra),
            ("model.extra.gguf", GgufRecord),
            ("hardware", Hardware), ("hardware.gpus[], hardware.cpu", Device),
            ("hardware.peers[]", PeerLink), ("*.flops_per_s", DeviceFlops),
            ("hardware.efficiency", HwEfficiency), ("hardware.latency_s", HwLatency), ("workload", Workload),
            ("solver", Solver), ("solver.options", SolverOptions), ("solver.size", SolverSize),
            ("placement[]", Placement), ("placement[].exec", BlockExec), ("staging", Staging),
            ("memory", Memory), ("memory.breakdown", Breakdown), ("memory.breakdown.gpu", GpuBreakdown), ("memory.breakdown.cpu", CpuBreakdown),
            ("predicted", Predicted), ("predicted.bottleneck", Bottleneck),
            ("schedule", Schedule), ("schedule.prefill, schedule.decode", PhaseSchedule), ("schedule.*.tasks[]", Task),
            ("inputs", Inputs), ("inputs.cli_args", CliArgs),
            ("pipeline", Pipeline), ("pipeline.stages[]", PipelineStage), ("pipeline.stages[].weights", StageTiers),
            ("pipeline.stages[].plan", StagePlan),
            ("pipeline.links[]", PipelineLink), ("pipeline.links[].legs[]", LinkLeg),
            ("pipeline.predicted", PipelinePredicted),
            ("pipeline.replica_step", ReplicaStep),
            ("pipeline.network", PipelineNetwork), ("pipeline.single_device", SingleDevice),
            ("pipeline.baselines.*", SplitBaseline),
            ("serving", Serving), ("serving.slo", ServingSlo), ("serving.curve[]", ServingPoint),
            ("inputs.cli_args.routing", Routing))
"""Where each model sits in a plan, for the README's key table (``a, b``: both places)."""
