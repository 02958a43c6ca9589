"""What one stage's process does: place its part of the plan, then run every pass of the
generation in step with the other stages, and (the last stage) gather what was measured.

Every stage runs the same sequence of passes: the warm-up (the prefill, and one decode step;
untimed, as in a single-GPU run), a barrier, the timed prefill, then one decode step per further
token. In each pass the first stage embeds the token ids and the others receive the hidden state
``x`` [B, S, D] from the stage before; each stage runs its blocks and sends ``x`` on; the last
stage computes the logits, samples the token and sends it back to the first, which feeds it to
the next pass. Messages carry the model's activation dtype (fp32 for a quantised model).

TTFT and TPOT are the last stage's clock: from the barrier to the first token, and between
consecutive tokens (one trip around the ring). Each stage also measures its *busy* time, the
seconds its own blocks computed in the timed prefill and, averaged, in a decode step: that is
what the plan's stage prediction (``pipeline.stages[i].ttft_s`` / ``tpot_s``) stands for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hetplan.errors import HetplanError
from hetplan.pipeline.record import stage_plan, whole_model
from hetplan.plan import Plan
from hetplan.runtime.distributed.part import stage_part
from hetplan.runtime.distributed.stage import StageRunner
from hetplan.runtime.kernels import quant
from hetplan.runtime.prompt import resolve_prompt, sample
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
    """ttft_s, tpot_s, decode_tokens_per_s: the whole pipeline, on the last stage's clock."""
    predicted: dict
    """The same keys from plan.json's ``pipeline.predicted``."""
    stages: list
    """Per stage: rank, gpu, layers, busy_prefill_s, busy_decode_s, predicted_ttft_s,
    predicted_tpot_s, peak_bytes, planned_bytes, mode."""
    step_s: tuple = ()
    logits: list | None = field(default=None, repr=False)

    @property
    def comparable(self) -> bool:
        """Whether measured times can be held against the plan's: no stage's GPU emulated."""
        return "emulated" not in self.modes

    def to_json_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "modes": self.modes, "measured": self.measured,
                "predicted": self.predicted, "comparable": self.comparable, "stages": self.stages}


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

    def __init__(self, plan: Plan, rank: int, opts: RunOptions, mode: str):
        stages = plan.pipeline["stages"]
        self.plan, self.rank, self.opts, self.mode = plan, rank, opts, mode
        self.world, self.name = len(stages), f"stage {rank}"
        self.first_layer, self.end_layer = stages[rank]["layers"]
        spec, wl = whole_model(plan), plan.workload
        self.part = stage_part(stage_plan(plan, rank), spec, self.first_layer, self.end_layer)
        source = weight_source(opts.weights, opts.seed, spec)
        self.ids, self.tokenizer = resolve_prompt(opts, source, spec, wl)
        self.gen_len = opts.gen_len or wl.gen_len
        needed = self.ids.shape[1] + self.gen_len - 1
        if needed > wl.context_len:
            raise HetplanError(f"--gen-len {self.gen_len} with a {self.ids.shape[1]}-token prompt needs {needed} "
                               f"cached tokens, but the plan sized its KV cache for {wl.context_len} (prompt_len "
                               f"{wl.prompt_len} + gen_len {wl.gen_len}); recompile with a larger --gen-len")
        self.runner = StageRunner(self.part, source, mode, self.ids.shape[0], self.name)
        if hasattr(source, "close"):
            source.close()

    def run(self, peers, progress=None) -> PipelineResult | None:
        """Generate with the other stages (``peers``: a ``Peers``, or None for a pipeline of one
        stage) -> the run's result on the last stage, None on the others."""
        plan, rank, world = self.plan, self.rank, self.world
        st = plan.pipeline["stages"][rank]
        try:
            ring = _Ring(self.runner, peers, rank, world, whole_model(plan).hidden, wire_dtype(plan), self.opts)
            run = ring.generate(self.ids, self.gen_len, progress)
            mine = {"rank": rank, "gpu": st.get("gpu"), "layers": [self.first_layer, self.end_layer], "mode": self.mode,
                    "busy_prefill_s": run["busy_prefill_s"], "busy_decode_s": run["busy_decode_s"],
                    "predicted_ttft_s": st["ttft_s"], "predicted_tpot_s": st["tpot_s"],
                    "peak_bytes": self.runner.devices.peak_bytes(),
                    "planned_bytes": {"gpu": self.part.memory["gpu_bytes"], "cpu": self.part.memory["cpu_bytes"]}}
            every = peers.gather(mine, world - 1) if peers else [mine]
        finally:
            self.close()
        if rank != world - 1:
            return None
        tpot = sum(run["step_s"]) / len(run["step_s"]) if run["step_s"] else None
        pred = plan.pipeline["predicted"]
        tokens = run["tokens"]
        return PipelineResult(
            tokens=tokens, text=[self.tokenizer.decode(t) for t in tokens] if self.tokenizer else None,
            modes=[s["mode"] for s in every],
            measured={"ttft_s": run["ttft_s"], "tpot_s": tpot,
                      "decode_tokens_per_s": self.ids.shape[0] / tpot if tpot else None},
            predicted={k: pred[k] for k in ("ttft_s", "tpot_s", "decode_tokens_per_s")}, stages=every,
            step_s=tuple(run["step_s"]), logits=run["logits"] or None)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


class _Ring:
    """The passes of one generation as this stage takes part in them."""

    def __init__(self, runner: StageRunner, peers, rank: int, world: int, hidden: int, wire: torch.dtype,
                 opts: RunOptions):
        self.runner, self.peers, self.rank, self.world = runner, peers, rank, world
        self.hidden, self.wire, self.opts = hidden, wire, opts
        self.first, self.last = rank == 0, rank == world - 1
        self.gen = torch.Generator().manual_seed(opts.seed)

    def one_pass(self, phase: str, start: int, ids: torch.Tensor | None, batch: int, n: int):
        """One pass of ``n`` new tokens per sequence -> (token [B] on the first and last stage,
        logits on the last, seconds this stage computed)."""
        step = self.runner.step(phase, start, n, batch, self.opts.all_logits)
        if self.first:
            inputs = {"ids": ids}
        else:
            x = self.peers.recv((batch, n, self.hidden), self.wire, self.rank - 1,
                                f"receiving the {phase} hidden state from")
            inputs = {"x": x.to(self.runner.dtype)}     # [B, S, D], in this stage's compute dtype
        out, busy = self.runner.forward(step, inputs)
        tok = logits = None
        if self.last:
            logits = out["logits"].to(device="cpu", dtype=torch.float32, copy=True)
            tok = sample(logits[:, -1] if logits.dim() == 3 else logits, self.opts.temperature, self.gen)
            if self.world > 1:
                self.peers.send(tok, 0, "sending the sampled token to")
        else:
            self.peers.send(out["x"].to(self.wire), self.rank + 1, f"sending the {phase} hidden state to")
        if self.first and self.world > 1:
            tok = self.peers.recv((batch,), torch.int64, self.world - 1, "receiving the sampled token from").cpu()
        return tok, logits, busy

    def generate(self, ids: torch.Tensor, gen_len: int, progress) -> dict:
        batch, prompt_len = ids.shape
        opts, kept = self.opts, []
        if opts.warmup:
            tok, _, _ = self.one_pass("prefill", 0, ids, batch, prompt_len)
            if gen_len > 1:  # writes position prompt_len, which the timed first decode step rewrites
                self.one_pass("decode", prompt_len, None if tok is None else tok[:, None], batch, 1)
            self.gen = torch.Generator().manual_seed(opts.seed)
        if self.peers:
            self.peers.barrier()
        t0 = time.perf_counter()
        tok, logits, busy_prefill = self.one_pass("prefill", 0, ids, batch, prompt_len)
        ttft_s = time.perf_counter() - t0
        tokens, step_s, busy_decode = [tok], [], []
        if opts.keep_logits or opts.all_logits:
            kept.append(logits)
        for i in range(gen_len - 1):
            if progress and self.last:
                progress("decode", i + 1, gen_len)
            s0 = time.perf_counter()
            tok, logits, busy = self.one_pass("decode", prompt_len + i, None if tok is None else tok[:, None],
                                              batch, 1)
            step_s.append(time.perf_counter() - s0)
            busy_decode.append(busy)
            tokens.append(tok)
            if opts.keep_logits:
                kept.append(logits)
        if progress and self.last:
            progress("decode", gen_len, gen_len)
        if self.peers:
            self.peers.reap(every=True)
        return {"tokens": torch.stack(tokens, dim=1).tolist() if self.last else None, "ttft_s": ttft_s,
                "step_s": step_s, "logits": kept, "busy_prefill_s": busy_prefill,
                "busy_decode_s": sum(busy_decode) / len(busy_decode) if busy_decode else None}
