"""Replicas at run time: a throughput plan of R replicas of an S-stage pipeline runs as R x S
processes (replica r's stage s is rank r x S + s), each replica on its own sequences; every
sequence's greedy tokens equal transformers' and its logits are within 1e-4 of their scale
(fp32, emulated GPUs); the report gathers every replica's tokens and rates; torchrun's
WORLD_SIZE must be R x S. The plan is compiled (``compile_plan``, ``--objective throughput``): a
4-layer llama of hidden 128 (~2.4 MB in fp32) on four 2 MiB GPUs, which hold it twice over: the
planner chooses two replicas of a two-stage pipeline (over four replicas of a GPU that streams
half of it, and one pipeline of four stages)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.plan import load_plan
from hetplan.runtime.distributed.launch import run_pipeline
from hetplan.runtime.distributed.ranks import Ranks
from hetplan.runtime.distributed.worker import expected_rate
from hetplan.runtime.session import RunOptions
from tests.distributed.pipelines import NODE, reference, save_llama

PROMPT_LEN, GEN_LEN, TOL = 8, 10, 1e-4


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    model_dir, node, path = d / "llama", d / "node.yaml", d / "plan.json"
    model = save_llama(model_dir, hidden=128, intermediate=256)
    node.write_text(NODE.replace("64MiB", "2MiB"))
    plan, _ = compile_plan(CompileRequest(model=str(model_dir), hw=str(node), objective="throughput", batch=1,
                                          prompt_len=PROMPT_LEN, gen_len=GEN_LEN, prefill_chunk=PROMPT_LEN,
                                          weight_dtype="fp32"))
    path.write_text(plan.to_json())
    plan = load_plan(path)
    pp = plan.pipeline
    assert pp["replicas"] == 2 and len(pp["stages"]) == 2 and pp["replica_step"] == {"gpus": 2}
    assert pp["micro_batches"] == 2
    return plan, path, model_dir, model


def test_every_replica_computes_what_transformers_computes_on_its_sequences(two_by_two):
    plan, _, model_dir, model = two_by_two
    r, m = 2, 2                          # replicas x micro-batches (one per stage) x batch 1
    ids = torch.randint(0, 128, (r * m, PROMPT_LEN), generator=torch.Generator().manual_seed(23))
    refs = [reference(model, ids[i:i + 1], GEN_LEN) for i in range(r * m)]
    opts = RunOptions(weights=str(model_dir), prompt_ids=tuple(map(tuple, ids.tolist())), all_logits=True,
                      keep_logits=True, emulate=True)
    result = run_pipeline(plan, opts, timeout_s=60)
    assert result.micro_batches == m and len(result.tokens) == r * m and len(result.logits) == GEN_LEN
    for i in range(r * m):              # replica after replica, micro-batch after micro-batch
        ref = refs[i]
        assert result.tokens[i] == ref["tokens"][0], f"sequence {i}"
        prefill, steps = result.logits[0][i:i + 1], torch.stack([lg[i:i + 1] for lg in result.logits[1:]])
        assert (prefill - ref["prefill"]).abs().max() <= TOL * ref["prefill"].abs().max()
        assert (steps - ref["steps"][1:]).abs().max() <= TOL * ref["steps"].abs().max()
    # four processes, each replica's stages on its own pair of GPUs, each loading its own layers
    assert [(s["replica"], s["rank"], s["gpu"], s["layers"]) for s in result.stages] == [
        (0, 0, 0, plan.pipeline["stages"][0]["layers"]), (0, 1, 1, plan.pipeline["stages"][1]["layers"]),
        (1, 0, 2, plan.pipeline["stages"][0]["layers"]), (1, 1, 3, plan.pipeline["stages"][1]["layers"])]
    each = result.replicas
    assert [e["replica"] for e in each] == [0, 1]
    for e in each:
        assert e["decode_tokens_per_s"] == pytest.approx(m * 1 / e["tpot_s"])
    assert result.measured["decode_tokens_per_s"] == pytest.approx(sum(e["decode_tokens_per_s"] for e in each))
    assert result.predicted["decode_tokens_per_s"] == plan.pipeline["predicted"]["decode_tokens_per_s"]
    assert not result.comparable


def test_the_rate_of_replicas_is_each_replicas_added():
    """The plan's rates are all replicas' (2 replicas, batch 2: pipelined 40 tok/s, a replica's
    slowest stage 0.1 s); each replica's M micro-batches take max(tpot, M x 0.1 s) a step:
    one micro-batch 2 x 2 / 0.4; three 2 x 6 / max(0.4, 0.3); eight 2 x 16 / max(0.4, 0.8)."""
    pred = {"tpot_s": 0.4, "pipelined_decode_tokens_per_s": 40.0}
    assert expected_rate(pred, 2, 1, 2) == pytest.approx(10.0)
    assert expected_rate(pred, 2, 3, 2) == pytest.approx(30.0)
    assert expected_rate(pred, 2, 8, 2) == pytest.approx(40.0)


def test_ranks_run_replica_after_replica_each_on_its_own_devices():
    side_by_side = Ranks.of({"replicas": 2, "stages": [{}, {}, {}], "replica_step": {"gpus": 3}})
    assert side_by_side.world == 6 and side_by_side.reporter == 5
    assert [side_by_side.split(k) for k in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert side_by_side.first_stages() == [0, 3]
    assert [side_by_side.gpu(k, g) for k, g in ((0, 0), (2, 2), (3, 0), (5, 2))] == [0, 2, 3, 5]
    assert side_by_side.name(4) == "replica 1 stage 1"
    own_nodes = Ranks.of({"replicas": 2, "stages": [{}, {}], "replica_step": {"nodes": 1}})
    assert [own_nodes.gpu(k, 0) for k in range(4)] == [0, 0, 0, 0]
    assert Ranks.of({"stages": [{}, {}]}).name(1) == "stage 1"


def test_a_world_size_other_than_replicas_times_stages_is_refused_naming_it(two_by_two):
    _, path, _, _ = two_by_two
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(path), "--weights", "random", "--emulate",
                          "--dist-timeout", "30"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    (line,) = [l for l in out.stderr.splitlines() if l.startswith("hetplan: error:")]
    assert "WORLD_SIZE 2, RANK 0: the plan's pipeline runs 2 replicas x 2 stage(s) = 4 processes; start 4" in line


def test_hetplan_exec_reports_every_replica(two_by_two):
    _, path, model_dir, model = two_by_two
    ids = torch.randint(0, 128, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(37))
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(path), "--weights", str(model_dir),
                          "--emulate", "--prompt-ids", ";".join(",".join(map(str, r)) for r in ids.tolist())],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ran 2 replicas of a pipeline of 2 stages, 4 processes")
    assert "each replica 2 micro-batch(es) of 1 sequence(s)" in lines[0]
    for i in range(4):
        want = reference(model, ids[i:i + 1], GEN_LEN)["tokens"][0]
        assert f"sequence {i}: {' '.join(map(str, want))}" in lines
    assert sum(l.startswith(("replica 0 decode tokens/s", "replica 1 decode tokens/s")) for l in lines) == 2
    assert any(l.startswith("decode tokens/s (all replicas)") for l in lines)
    assert "times not comparable with the plan" in lines[-1]
