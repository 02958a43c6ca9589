"""What one stage's process does: place its part of the plan, then run every pass of the
generation in step with the other stages (``flow``), and (the last stage) gather what was
measured into the run's result.

``micro_batches`` groups of the plan's ``batch`` sequences go through each replica's stages
interleaved (``flow.passes``); messages carry the model's activation dtype (fp32 for a quantised
model). With ``R`` replicas (``ranks``) the run takes ``R x micro_batches x batch`` sequences,
replica ``r`` the ``r``-th consecutive ``micro_batches x batch`` of them (the plan's ``batch`` is
one replica's, so they always divide evenly). TTFT and TPOT are each replica's last stage's
clock: from the barrier (every process's) to micro-batch 0's first token, and the decode window
over its ``gen_len - 1`` steps (each step: every micro-batch's next token; one trip around the
ring when ``micro_batches`` is 1). A replica's decode tokens/s is ``micro_batches x batch`` over
its TPOT; the run's, the replicas' added (they decode at once). Every process's measurements,
and each replica's tokens, go to the last rank (``Ranks.reporter``), which puts the result
together. Each stage also measures its *busy* time, the seconds its own blocks computed per pass
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
from hetplan.runtime.distributed.ranks import Ranks
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
    """Per process (replica after replica): replica, rank (the stage in its replica), gpu,
    layers, busy_prefill_s, busy_decode_s (per pass), busy_s and idle_s (per phase, in all),
    predicted_ttft_s, predicted_tpot_s, peak_bytes, planned_bytes (with every micro-batch's KV
    caches), mode."""
    step_s: tuple = ()
    logits: list | None = field(default=None, repr=False)
    """Per kept step: fp32 logits of every sequence (micro-batch after micro-batch)."""
    micro_batches: int = 1
    replicas: list = field(default_factory=list)
    """Per replica: replica, ttft_s, tpot_s, decode_tokens_per_s (measured on its last stage) and
    predicted_decode_tokens_per_s (``expected_rate`` of one replica)."""

    @property
    def comparable(self) -> bool:
        """Whether measured times can be held against the plan's: no stage's GPU emulated."""
        return "emulated" not in self.modes

    def to_json_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "modes": self.modes, "measured": self.measured,
                "predicted": self.predicted, "comparable": self.comparable, "stages": self.stages,
                "micro_batches": self.micro_batches, "replicas": self.replicas}


def default_micro_batches(plan: Plan) -> int:
    """The micro-batches the plan's stages are sized for (``pipeline.micro_batches``); for a plan
    written before it was recorded, 1 when its stages run in turn (``pipeline.objective``
    ``sum``), as many as its stages for a throughput plan (``max``: micro-batches in every stage)."""
    pp = plan.pipeline
    if pp.get("micro_batches"):
        return pp["micro_batches"]
    return len(pp["stages"]) if pp["objective"] == "max" else 1


def planned_micro_batches(plan: Plan) -> int:
    """The KV caches each stage's plan holds (``pipeline.micro_batches``; 1 where absent)."""
    return plan.pipeline.get("micro_batches") or 1


def expected_rate(predicted: dict, batch: int, micro_batches: int, replicas: int = 1) -> float:
    """Decode tokens/s the plan's stage and link times give ``R`` replicas each running ``M``
    micro-batches of ``batch``: each micro-batch goes once around its replica's stages per step
    (``tpot_s``), and the slowest stage or link takes ``T_b = R x batch /
    pipelined_decode_tokens_per_s`` (the plan's rate is all replicas') for each, so a step of all
    of them takes ``max(tpot_s, M x T_b)``, and the rate is ``R x M x batch`` over that."""
    slowest_s = replicas * batch / predicted["pipelined_decode_tokens_per_s"]
    return replicas * micro_batches * batch / max(predicted["tpot_s"], micro_batches * slowest_s)


def wire_dtype(plan: Plan) -> torch.dtype:
    """The dtype of the hidden state between stages: the weights' (fp32 for quantised ones, which
    a CUDA stage computes in bf16 and a CPU one in fp32)."""
    w = whole_model(plan).weight_dtype
    return torch.float32 if quant.is_quantised(w) else torch_dtype(w, "--weight-dtype")


def stage_device(plan: Plan, rank: int, emulate: bool | None) -> tuple[str, int]:
    """(mode, CUDA device index) of process ``rank`` (a replica's stage, ``Ranks``) on this
    machine; a stage on a GPU this machine does not have is refused."""
    ranks = Ranks.of(plan.pipeline)
    s = ranks.split(rank)[1]
    mode = choose_mode(stage_plan(plan, s), emulate)
    gpu = ranks.gpu(rank, plan.pipeline["stages"][s].get("gpu"))
    if mode == "cuda" and (gpu or 0) >= torch.cuda.device_count():
        raise HetplanError(f"{ranks.name(rank)}: the plan runs it on GPU {gpu}, but this machine has "
                           f"{torch.cuda.device_count()} CUDA device(s); run it on a node with that GPU, or "
                           f"pass --emulate")
    return mode, gpu or 0


class PreparedStage:
    """Process ``rank`` of a run of ``plan.pipeline`` (a replica's stage, ``Ranks``) placed on
    this machine, not yet run."""

    def __init__(self, plan: Plan, rank: int, opts: RunOptions, mode: str, micro_batches: int = 1):
        stages = plan.pipeline["stages"]
        self.ranks = ranks = Ranks.of(plan.pipeline)
        self.plan, self.rank, self.opts, self.mode = plan, rank, opts, mode
        self.micro_batches = micro_batches
        self.replica, self.stage = ranks.split(rank)
        self.world, self.name = len(stages), ranks.name(rank)
        self.first_layer, self.end_layer = stages[self.stage]["layers"]
        spec, wl = whole_model(plan), plan.workload
        self.part = stage_part(stage_plan(plan, self.stage), spec, self.first_layer, self.end_layer)
        source = weight_source(opts.weights, opts.seed, spec)
        self.batch = wl.batch
        ids, self.tokenizer = resolve_prompt(opts, source, spec,
                                             _for_micro_batches(opts, wl, micro_batches, ranks.replicas))
        mine = micro_batches * wl.batch        # this replica's sequences, the r-th of every replica's
        self.ids = ids[self.replica * mine:(self.replica + 1) * mine]
        self.gen_len = opts.gen_len or wl.gen_len
        needed = self.ids.shape[1] + self.gen_len - 1
        if needed > wl.context_len:
            raise HetplanError(f"--gen-len {self.gen_len} with a {self.ids.shape[1]}-token prompt needs {needed} "
                               f"cached tokens, but the plan sized its KV cache for {wl.context_len} (prompt_len "
                               f"{wl.prompt_len} + gen_len {wl.gen_len}); recompile with a larger --gen-len")
        self.runner = StageRunner(self.part, source, mode, self.batch, self.name, micro_batches,
                                  planned_micro_batches(plan))
        if hasattr(source, "close"):
            source.close()

    def run(self, peers, progress=None) -> PipelineResult | None:
        """Generate with the other stages (``peers``: a ``Peers``, or None for a run of one
        process) -> the run's result on the reporting rank, None on the others."""
        plan, rank, m = self.plan, self.rank, self.micro_batches
        st = plan.pipeline["stages"][self.stage]
        try:
            flow = Flow(self.runner, peers, self.stage, self.world, whole_model(plan).hidden, wire_dtype(plan),
                        self.opts)
            run = flow.generate(list(self.ids.split(self.batch)), self.gen_len, progress)
            mine = {"rank": self.stage, "replica": self.replica, "gpu": self.ranks.gpu(rank, st.get("gpu")),
                    "layers": [self.first_layer, self.end_layer], "mode": self.mode,
                    "busy_prefill_s": run["busy_prefill_s"], "busy_decode_s": run["busy_decode_s"],
                    "busy_s": run["busy_s"], "idle_s": run["idle_s"],
                    "predicted_ttft_s": st["ttft_s"], "predicted_tpot_s": st["tpot_s"],
                    "peak_bytes": self.runner.devices.peak_bytes(), "planned_bytes": self.runner.planned_bytes}
            out = {"stage": mine, "run": run if self.stage == self.world - 1 else None}
            every = peers.gather(out, self.ranks.reporter) if peers else [out]
        finally:
            self.close()
        if rank != self.ranks.reporter:
            return None
        return self._result(every)

    def _result(self, every: list) -> PipelineResult:
        """The run's result from every process's ``{"stage", "run"}`` (by rank; ``run`` from each
        replica's last stage)."""
        pred, m, r = self.plan.pipeline["predicted"], self.micro_batches, self.ranks.replicas
        runs = [every[self.ranks.rank(i, self.world - 1)]["run"] for i in range(r)]
        steps = self.gen_len - 1
        each = []
        for i, run in enumerate(runs):
            tpot = run["decode_s"] / steps if steps else None
            each.append({"replica": i, "ttft_s": run["ttft_s"], "tpot_s": tpot,
                         "decode_tokens_per_s": m * self.batch / tpot if tpot else None,
                         "predicted_decode_tokens_per_s": expected_rate(pred, self.batch, m, r) / r})
        tokens = [seq for run in runs for seq in run["tokens"]]
        n_logits = len(runs[0]["logits"])
        logits = [torch.cat([run["logits"][j] for run in runs]) for j in range(n_logits)]
        rates = [e["decode_tokens_per_s"] for e in each]
        return PipelineResult(
            tokens=tokens, text=[self.tokenizer.decode(t) for t in tokens] if self.tokenizer else None,
            modes=[e["stage"]["mode"] for e in every],
            measured={"ttft_s": max(run["ttft_s"] for run in runs), "prefill_s": max(run["prefill_s"] for run in runs),
                      "tpot_s": max(e["tpot_s"] for e in each) if steps else None,
                      "decode_tokens_per_s": sum(rates) if steps else None},
            predicted=dict({k: pred[k] for k in ("ttft_s", "tpot_s", "decode_tokens_per_s",
                                                 "pipelined_decode_tokens_per_s")},
                           micro_batch_decode_tokens_per_s=expected_rate(pred, self.batch, m, r)),
            stages=[e["stage"] for e in every], step_s=tuple(runs[-1]["step_s"]), logits=logits or None,
            micro_batches=m, replicas=each)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


def _for_micro_batches(opts: RunOptions, wl, micro_batches: int, replicas: int = 1):
    """The workload whose batch is every replica's micro-batches' sequences, as the prompt is
    resolved for it: one sequence repeated, or ``replicas x micro_batches x batch`` of them
    (replica after replica, micro-batch after micro-batch)."""
    total = replicas * micro_batches * wl.batch
    given = len(opts.prompt_ids) if opts.prompt_ids is not None else 1
    if total > wl.batch and given not in (1, total):
        of = f"{replicas} replicas x " if replicas > 1 else ""
        raise HetplanError(f"--prompt-ids: {given} sequences, but {of}{micro_batches} micro-batches of the plan's "
                           f"batch {wl.batch} take {total}; give one sequence (repeated) or {total} ("
                           f"{'replica after replica, ' if replicas > 1 else ''}micro-batch after micro-batch)")
    return dataclasses.replace(wl, batch=total)
