"""The independent replay of a plan's pipeline: each stage's own plan replayed like any plan,
each link restated from what it is made of, and the pipeline's predictions restated from those.

A plan over several devices records its stages (``pipeline.stages[i]``, each with its own
single-device plan) and the links between consecutive stages (``pipeline.links[j]``, each with
its legs). This module checks, from those records alone:

- every stage's plan, read back with ``hetplan.pipeline.record.stage_plan``, passes
  ``simulate.check_plan`` (its schedule replayed, its staging and memory checked), and the
  stage's recorded ``ttft_s`` / ``tpot_s`` are its replayed makespans; the stages cut the whole
  model's layers ``[0, n_layers)`` in order;
- every link's ``prefill_s`` / ``decode_s`` is its legs in turn, ``sum(bytes / bytes_per_s +
  latency_s)``, for the hidden state a stage hands the next, restated here: ``tokens x hidden x
  a`` bytes (``tokens`` = batch x prompt_len for a prefill, batch for a decode step; ``a`` = 4
  for fp32 weights, else 2);
- every stage's KV caches are sized for the micro-batches in flight (``pipeline.micro_batches``,
  1 where absent; under the throughput objective ``max`` one per stage, else 1): each attention
  block's ``kv_bytes`` is ``micro_batches x batch x context x kv_bytes_per_token`` (``2 x
  kv_heads x head_dim x`` the KV dtype's bytes for a plain cache), so a run at the plan's own
  micro-batch count is not refused for memory;
- ``pipeline.predicted``: one sequence crosses every stage and link in turn, so ``ttft`` and
  ``tpot`` are their sums, ``latency = ttft + gen_len x tpot``, the rates ``replicas x batch``
  (``x prompt_len``) over them; micro-batches filling the stages leave the chain of serial
  resources (stage, link, stage, ...) one interval apart once it is full, the interval replayed
  here by pushing micro-batches through the chain (``micro_batch_ends_s``), which is the slowest
  resource's time; ``pipelined_decode = replicas x batch / interval``.

Knows nothing about the cost model, the solvers or how the stages were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.plan.simulate import PHASES, PlanInvalid, check_plan

KEY = {"prefill": "ttft_s", "decode": "tpot_s"}


@dataclass(frozen=True)
class PipelineReplay:
    stages: tuple
    """Each stage's ``SimResult``."""
    links: tuple
    """Per link: phase -> restated seconds (the recorded ones where the link records no legs)."""
    predicted: dict
    """``pipeline.predicted`` as restated here."""


def check_pipeline(plan, rel_tol: float = 1e-6) -> PipelineReplay:
    """Replay ``plan.pipeline`` (module docstring); raise PlanInvalid naming the first stage, link
    or prediction that its records do not bear out by more than ``rel_tol``."""
    from hetplan.pipeline.record import stage_plan, whole_model

    pp = plan.pipeline
    if not pp or not pp.get("stages"):
        raise PlanInvalid("the plan has no pipeline to replay")
    model = whole_model(plan)
    _check_layers(pp["stages"], model.n_layers)
    if len(pp["links"]) != len(pp["stages"]) - 1:
        raise PlanInvalid(f"pipeline: {len(pp['stages'])} stages need {len(pp['stages']) - 1} links, the plan "
                          f"records {len(pp['links'])}")
    _check_micro_batches(pp)
    sims = []
    for i, rec in enumerate(pp["stages"]):
        try:
            sim = check_plan(stage_plan(plan, i), rel_tol)
        except PlanInvalid as e:
            raise PlanInvalid(f"pipeline.stages[{i}].plan: {e}") from None
        _check_kv(rec["plan"]["placement"], i, model, plan.workload, pp.get("micro_batches") or 1, rel_tol)
        for phase in PHASES:
            _same(rec[KEY[phase]], sim.makespan_s[phase], f"pipeline.stages[{i}].{KEY[phase]}",
                  f"replaying stage {i}'s {phase} schedule takes", rel_tol)
        sims.append(sim)
    links = tuple(_link_s(l, j, model, plan.workload, rel_tol) for j, l in enumerate(pp["links"]))
    predicted = restated_predictions([{ph: s.makespan_s[ph] for ph in PHASES} for s in sims], links,
                                     plan.workload, pp.get("replicas") or 1)
    for key, ours in predicted.items():
        _same(pp["predicted"][key], ours, f"pipeline.predicted.{key}", "its stages and links replay to", rel_tol)
    return PipelineReplay(tuple(sims), links, predicted)


def restated_predictions(stages: list, links: list, wl, replicas: int = 1) -> dict:
    """``pipeline.predicted`` from each stage's and link's seconds per phase (module docstring)."""
    ttft, tpot = (sum(s[ph] for s in stages) + sum(l[ph] for l in links) for ph in PHASES)
    chain = [stages[0]["decode"]]
    for link, stage in zip(links, stages[1:]):
        chain += [link["decode"], stage["decode"]]
    ends = micro_batch_ends_s(chain, 2 * len(chain) + 2)
    interval = ends[-1] - ends[-2]
    return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": ttft + wl.gen_len * tpot,
            "decode_tokens_per_s": replicas * wl.batch / tpot,
            "prefill_tokens_per_s": replicas * wl.batch * wl.prompt_len / ttft,
            "pipelined_decode_tokens_per_s": replicas * wl.batch / interval}


def micro_batch_ends_s(chain: list, n: int) -> list:
    """When each of ``n`` micro-batches leaves the last of a chain of serial resources taking
    ``chain[s]`` seconds each: micro-batch ``i`` enters resource ``s`` once it left ``s - 1``
    and micro-batch ``i - 1`` left ``s``."""
    free = [0.0] * len(chain)   # when each resource finished its last micro-batch
    ends = []
    for _ in range(n):
        t = 0.0
        for s, d in enumerate(chain):
            t = max(t, free[s]) + d
            free[s] = t
        ends.append(t)
    return ends


def hidden_bytes(model, wl, phase: str) -> float:
    """The hidden state one stage hands the next (restated; module docstring)."""
    tokens = wl.batch * (wl.prompt_len if phase == "prefill" else 1)
    return tokens * model.hidden * (4 if model.weight_dtype == "fp32" else 2)


def _link_s(link: dict, j: int, model, wl, rel_tol: float) -> dict:
    legs = link.get("legs")
    if legs is None:  # an older plan: nothing to restate the link from
        return {ph: link[f"{ph}_s"] for ph in PHASES}
    out = {}
    for ph in PHASES:
        nbytes = hidden_bytes(model, wl, ph)
        out[ph] = sum(nbytes / leg["bytes_per_s"] + leg["latency_s"] for leg in legs)
        _same(link[f"{ph}_s"], out[ph], f"pipeline.links[{j}].{ph}_s",
              f"{nbytes:.0f} bytes over its legs ({', '.join(leg['via'] for leg in legs)}) take", rel_tol)
    return out


def _check_micro_batches(pp: dict) -> None:
    m = pp.get("micro_batches")
    if m is None:
        return
    want = len(pp["stages"]) if pp["objective"] == "max" else 1
    if m != want:
        how = "one per stage" if pp["objective"] == "max" else "1, the stages taking turns"
        raise PlanInvalid(f"pipeline.micro_batches = {m}, but a pipeline with objective {pp['objective']!r} over "
                          f"{len(pp['stages'])} stage(s) keeps {want} in flight ({how}); recompile the plan")


def _check_kv(placement: list, i: int, model, wl, micro_batches: int, rel_tol: float) -> None:
    """Each KV cache of stage ``i`` holds every micro-batch's (module docstring)."""
    want = micro_batches * wl.batch * wl.context_len * model.kv_bytes_per_token()
    for p in placement:
        if p["kv"] is not None:
            _same(p["kv_bytes"], want, f"pipeline.stages[{i}].plan: block {p['block']}'s kv_bytes",
                  f"{micro_batches} micro-batch(es) x batch {wl.batch} x {wl.context_len} tokens x "
                  f"{model.kv_bytes_per_token():g} bytes per token and layer take", rel_tol)


def _check_layers(stages: list, n_layers: int) -> None:
    end = 0
    for i, s in enumerate(stages):
        first, last = s["layers"]
        if first != end or last <= first:
            raise PlanInvalid(f"pipeline.stages[{i}].layers = [{first}, {last}): the stages must cut the model's "
                              f"layers in order, this one starting at layer {end}")
        end = last
    if end != n_layers:
        raise PlanInvalid(f"pipeline.stages: they end at layer {end}, the model has {n_layers}")


def _same(recorded: float, replayed: float, what: str, says: str, rel_tol: float) -> None:
    if abs(recorded - replayed) > rel_tol * max(abs(replayed), 1e-12):
        raise PlanInvalid(f"{what} = {recorded:.9g}, but {says} {replayed:.9g}; recompile the plan")
