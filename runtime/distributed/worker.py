"""What one stage's process does: place its part of the plan, then run every pass of the
generation in step with the other stages (``flow``), and (the last stage) gather what was
measured into the run's result.

``micro_batches`` groups of the plan's ``batch`` sequences go through the stages interleaved
(``flow.passes``); messages carry the model's activation dtype (fp32 for a quantised model).
TTFT and TPOT are the last stage's clock: from the barrier to micro-batch 0's first token, and
the decode window over its ``gen_len - 1`` steps (each step: every micro-batch's next token; one
trip around the ring when ``micro_batches`` is 1). Decode tokens/s is ``micro_batches x batch``
over TPOT. Each stage also measures its *busy* time, the seconds its own blocks computed per pass
(prefill and, averaged, decode: what the plan's stage prediction ``pipeline.stages[i].ttft_s`` /
``tpot_s`` stands for) and in all, and its *idle* time per phase.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from hetplan.errors import HetplanError
from hetplan.pipeline.record import stage_plan, whole_model
from hetplan.plan import Plan
from hetplan.runtime.distributed.flow import Flow
from hetplan.runtime.distributed.part import stage_part
from hetplan.runtime.distributed.stage import StageRunner
from hetplan.runtime.kernels import quant
from hetplan.runtime.prompt import resolve_prompt
from hetplan.runtime.session import RunOptions, choose_mode
from hetplan.runtime.weights import torch_dtype, weight_source


@dataclass(frozen=True)
class PipelineResult:
    """What a pipeline run measured, on the last stage."""
    tokens: list
    """Generated ids per sequence."""
    text: list | None
    modes: list
    """Per stage: ``cuda``, ``emulated`` or ``cpu``."""
    measured: dict
    """ttft_s, prefill_s (every micro-batch's prompt), tpot_s, decode_tokens_per_s: the whole
    pipeline, on the last stage's clock."""
    predicted: dict
    """ttft_s, tpot_s, decode_tokens_per_s and pipelined_decode_tokens_per_s from plan.json's
    ``pipeline.predicted``, and ``micro_batch_decode_tokens_per_s`` (``expected_rate``)."""
    stages: list
    """Per stage: rank, gpu, layers, busy_prefill_s, busy_decode_s (per pass), busy_s and
    idle_s (per phase, in all), predicted_ttft_s, predicted_tpot_s, peak_bytes, planned_bytes
    (with every micro-batch's KV caches), mode."""
    step_s: tuple = ()
    logits: list | None = field(default=None, repr=False)
    """Per kept step: fp32 logits of every sequence (micro-batch after micro-batch)."""
    micro_batches: int = 1

    @property
    def comparable(self) -> bool:
        """Whether measured times can be held against the plan's: no stage's GPU emulated."""
        return "emulated" not in self.modes

    def to_json_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "modes": self.modes, "measured": self.measured,
                "predicted": self.predicted, "comparable": self.comparable, "stages": self.stages,
                "micro_batches": self.micro_batches}


def default_micro_batches(plan: Plan) -> int:
    """1 for a plan whose stages run in turn (``pipeline.objective`` ``sum``); as many as its
    stages for a throughput plan (``max``: micro-batches in every stage)."""
    return len(plan.pipeline["stages"]) if plan.pipeline["objective"] == "max" else 1


def expected_rate(predicted: dict, batch: int, micro_batches: int) -> float:
    """Decode tokens/s the plan's stage and link times give ``M`` micro-batches of ``batch``:
    each of them goes once around the stages per step (``tpot_s``), and the slowest stage or
    link takes ``T_b = batch / pipelined_decode_tokens_per_s`` for each, so a step of all of
    them takes ``max(tpot_s, M x T_b)`` and the rate is ``M x batch`` over that."""
    slowest_s = batch / predicted["pipelined_decode_tokens_per_s"]
    return micro_batches * batch / max(predicted["tpot_s"], micro_batches * slowest_s)


def wire_dtype(plan: Plan) -> torch.dtype:
    """The dtype of the hidden state between stages: the weights' (fp32 for quantised ones, which
    a CUDA stage computes in bf16 and a CPU one in fp32)."""
    w = whole_model(plan).weight_dtype
    return torch.float32 if quant.is_quantised(w) else torch_dtype(w, "--weight-dtype")


def stage_device(plan: Plan, rank: int, emulate: bool | None) -> tuple[str, int]:
    """(mode, CUDA device index) of stage ``rank`` on this machine; a stage on a GPU this machine
    does not have is refused."""
    st = plan.pipeline["stages"][rank]
    mode = choose_mode(stage_plan(plan, rank), emulate)
    gpu = st.get("gpu")
    if mode == "cuda" and (gpu or 0) >= torch.cuda.device_count():
        raise HetplanError(f"stage {rank}: the plan runs it on GPU {gpu}, but this machine has "
                           f"{torch.cuda.device_count()} CUDA device(s); run it on a node with that GPU, or "
                           f"pass --emulate")
    return mode, gpu or 0


class PreparedStage:
    """Stage ``rank`` of ``plan.pipeline`` placed on this machine, not yet run."""

    def __init__(self, plan: Plan, rank: int, opts: RunOptions, mode: str, micro_batches: int = 1):
        stages = plan.pipeline["stages"]
        self.plan, self.rank, self.opts, self.mode = plan, rank, opts, mode
        self.micro_batches = micro_batches
        self.world, self.name = len(stages), f"stage {rank}"
        self.first_layer, self.end_layer = stages[rank]["layers"]
        spec, wl = whole_model(plan), plan.workload
        self.part = stage_part(stage_plan(plan, rank), spec, self.first_layer, self.end_layer)
        source = weight_source(opts.weights, opts.seed, spec)
        self.batch = wl.batch
        self.ids, self.tokenizer = resolve_prompt(opts, source, spec, _for_micro_batches(opts, wl, micro_batches))
        self.gen_len = opts.gen_len or wl.gen_len
        needed = self.ids.shape[1] + self.gen_len - 1
        if needed > wl.context_len:
            raise HetplanError(f"--gen-len {self.gen_len} with a {self.ids.shape[1]}-token prompt needs {needed} "
                               f"cached tokens, but the plan sized its KV cache for {wl.context_len} (prompt_len "
                               f"{wl.prompt_len} + gen_len {wl.gen_len}); recompile with a larger --gen-len")
        self.runner = StageRunner(self.part, source, mode, self.batch, self.name, micro_batches)
        if hasattr(source, "close"):
            source.close()

    def run(self, peers, progress=None) -> PipelineResult | None:
        """Generate with the other stages (``peers``: a ``Peers``, or None for a pipeline of one
        stage) -> the run's result on the last stage, None on the others."""
        plan, rank, world, m = self.plan, self.rank, self.world, self.micro_batches
        st = plan.pipeline["stages"][rank]
        try:
            flow = Flow(self.runner, peers, rank, world, whole_model(plan).hidden, wire_dtype(plan), self.opts)
            run = flow.generate(list(self.ids.split(self.batch)), self.gen_len, progress)
            mine = {"rank": rank, "gpu": st.get("gpu"), "layers": [self.first_layer, self.end_layer], "mode": self.mode,
                    "busy_prefill_s": run["busy_prefill_s"], "busy_decode_s": run["busy_decode_s"],
                    "busy_s": run["busy_s"], "idle_s": run["idle_s"],
                    "predicted_ttft_s": st["ttft_s"], "predicted_tpot_s": st["tpot_s"],
                    "peak_bytes": self.runner.devices.peak_bytes(), "planned_bytes": self.runner.planned_bytes}
            every = peers.gather(mine, world - 1) if peers else [mine]
        finally:
            self.close()
        if rank != world - 1:
            return None
        tpot = run["decode_s"] / (self.gen_len - 1) if self.gen_len > 1 else None
        pred = plan.pipeline["predicted"]
        tokens = run["tokens"]
        return PipelineResult(
            tokens=tokens, text=[self.tokenizer.decode(t) for t in tokens] if self.tokenizer else None,
            modes=[s["mode"] for s in every],
            measured={"ttft_s": run["ttft_s"], "prefill_s": run["prefill_s"], "tpot_s": tpot,
                      "decode_tokens_per_s": m * self.batch / tpot if tpot else None},
            predicted=dict({k: pred[k] for k in ("ttft_s", "tpot_s", "decode_tokens_per_s",
                                                 "pipelined_decode_tokens_per_s")},
                           micro_batch_decode_tokens_per_s=expected_rate(pred, self.batch, m)),
            stages=every, step_s=tuple(run["step_s"]), logits=run["logits"] or None, micro_batches=m)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


def _for_micro_batches(opts: RunOptions, wl, micro_batches: int):
    """The workload whose batch is every micro-batch's sequences, as the prompt is resolved for
    it: one sequence repeated, or ``micro_batches x batch`` of them (group after group)."""
    total = micro_batches * wl.batch
    given = len(opts.prompt_ids) if opts.prompt_ids is not None else 1
    if micro_batches > 1 and given not in (1, total):
        raise HetplanError(f"--prompt-ids: {given} sequences, but {micro_batches} micro-batches of the plan's "
                           f"batch {wl.batch} take {total}; give one sequence (repeated) or {total} (micro-batch "
                           f"after micro-batch)")
    return dataclasses.replace(wl, batch=total)
