"""Numerics do not depend on timing: a delay injected before every task of one lane (the GPU's
compute stream, the weight-load stream, the activation-copy streams, the prompt-KV stream; on
the emulated GPU the thread serving that lane) leaves every step's logits bit for bit as an
undelayed run's. A missing wait would let a reader see a half-copied slot or activation."""

from __future__ import annotations

import time

import pytest
import torch
from tests.exec.test_scheduling import GEN_LEN, MODES, compiled, cpu_kv_plan, env  # noqa: F401 - fixture

from hetplan.runtime.executor import Executor
from hetplan.runtime.session import RunOptions, run_plan

DELAY_S = 0.002
CUDA_SLEEP_CYCLES = 2_000_000
"""About 1 ms of spinning on the delayed stream at ~2 GHz."""


def logits(plan, mode):
    r = run_plan(plan, RunOptions(weights="random", seed=2, gen_len=GEN_LEN, keep_logits=True,
                                  emulate=mode == "emulated"))
    return r.tokens, r.logits


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan_kind, lane", [("stream", "h2d"), ("stream", "gpu"), ("cpu-kv", "d2h"),
                                             ("cpu-kv", "d2h_act"), ("cpu-kv", "h2d_act"), ("cpu-kv", "cpu")])
def test_a_delayed_lane_changes_no_logit(env, monkeypatch, plan_kind, lane, mode):
    plan = cpu_kv_plan(env) if plan_kind == "cpu-kv" else compiled(env, "stream", "200KiB")
    assert any(t.resource == lane for s in plan.schedule.values() for t in s.tasks)
    tokens, want = logits(plan, mode)
    execute = Executor._execute

    def delayed(self, run, op, stream):
        if op.task.resource == lane:
            if stream is not None:
                torch.cuda._sleep(CUDA_SLEEP_CYCLES)   # queued on the lane's stream: its later work waits
            else:
                time.sleep(DELAY_S)
        return execute(self, run, op, stream)

    monkeypatch.setattr(Executor, "_execute", delayed)
    got_tokens, got = logits(plan, mode)
    assert got_tokens == tokens
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
