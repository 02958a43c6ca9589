"""Replicas (data parallel) under the throughput objective: alike groups of devices each running
the same pipeline, their rates added; figures derived by hand from one group's solved stages."""

import dataclasses
import json

import pytest
from pydantic import ValidationError

from hetplan.compiler import CompileRequest, _workload, stage_solver
from hetplan.errors import InfeasibleError
from hetplan.hardware import PeerLink
from hetplan.pipeline import plan_pipeline, stage_problem
from hetplan.pipeline.compile import best_batch, best_replicas, replicated
from hetplan.pipeline.plan import pipeline_lower_bound
from hetplan.pipeline.replicas import first_group, replica_counts, replicas_fit_dram
from hetplan.pipeline.topology import Topology
from hetplan.schema.pipeline import Pipeline
from hetplan.workload import Workload
from tests.conftest import GIB, tiny_node, tiny_spec

WL = Workload(batch=1, prompt_len=64, gen_len=16, objective="throughput", prefill_chunk=64)
SOLVE = stage_solver(CompileRequest(model="tiny", hw="tiny"))


def gpus(*gib: float, kind: str = "nvswitch"):
    """A tiny node with one GPU of ``gib`` GiB per argument, every pair linked at 100 GB/s."""
    hw = tiny_node(gib[0])
    cards = tuple(dataclasses.replace(hw.gpu, memory_bytes=int(g * GIB)) for g in gib)
    peers = tuple(PeerLink(a, b, kind, 100e9) for a in range(len(gib)) for b in range(a + 1, len(gib)))
    return dataclasses.replace(hw, gpus=cards, peers=peers)


def test_four_replicas_of_a_model_fitting_one_gpu_beat_a_four_stage_pipeline():
    spec = tiny_spec(n_layers=4)
    hw = gpus(1, 1, 1, 1)
    one = SOLVE(stage_problem(spec, hw, WL, 0, 0, 4))  # the whole model on one GPU
    assert one is not None
    pipe = plan_pipeline(spec, hw, WL, SOLVE, objective="max")
    best = best_replicas(spec, Topology.of(hw), pipe, SOLVE)
    # each of 4 GPUs decodes its own sequence in one GPU's TPOT: 4 x batch / tpot
    want = 4 * WL.batch / one.predicted["tpot_s"]
    assert best.replicas == 4 and len(best.stages) == 1
    assert best.predicted()["pipelined_decode_tokens_per_s"] == pytest.approx(want, rel=1e-9)
    assert best.predicted()["decode_tokens_per_s"] == pytest.approx(want, rel=1e-9)
    # the best single pipeline over the 4 GPUs runs at its slowest stage or link, below that
    assert want > pipe.predicted()["pipelined_decode_tokens_per_s"]
    d = best.to_dict()
    assert d["replicas"] == 4 and d["devices"] == 4
    Pipeline.model_validate(json.loads(json.dumps(d)))  # the schema takes it, and no count below 1
    with pytest.raises(ValidationError, match="replicas"):
        Pipeline.model_validate(json.loads(json.dumps(dict(d, replicas=0))))


def test_the_replica_count_is_the_one_serving_the_most_sequences():
    # ~3 MiB GPUs: one holds the model only by keeping blocks in DRAM, two hold it resident.
    # Candidates, each priced from its own solved stages: 4 replicas of one GPU (4 / its TPOT),
    # 2 replicas of the best pair (2 / the pair's slowest stage or link), one pipeline over all 4
    spec = tiny_spec(n_layers=4)
    hw = gpus(*[3 / 1024] * 4)
    one = SOLVE(stage_problem(spec, hw, WL, 0, 0, 4))
    assert one.memory["cpu_bytes"] > 0 and any(p["weights"] != "gpu" for p in one.placement)
    pair = plan_pipeline(spec, gpus(3 / 1024, 3 / 1024), WL, SOLVE, objective="max")
    pair_slowest = max([s.plan.predicted["tpot_s"] for s in pair.stages] + [l["decode_s"] for l in pair.links])
    whole = plan_pipeline(spec, hw, WL, SOLVE, objective="max")
    rates = {4: 4 * WL.batch / one.predicted["tpot_s"], 2: 2 * WL.batch / pair_slowest,
             1: whole.predicted()["pipelined_decode_tokens_per_s"]}
    best = best_replicas(spec, Topology.of(hw), whole, SOLVE)
    assert best.replicas == max(rates, key=rates.get)
    assert best.predicted()["pipelined_decode_tokens_per_s"] == pytest.approx(max(rates.values()), rel=1e-9)


def test_only_alike_groups_of_devices_make_replicas():
    assert replica_counts(Topology.of(gpus(1, 1, 1, 1))) == [2, 4]
    assert replica_counts(Topology.of(gpus(1, 2, 1, 2))) == [2]  # [1, 2] twice
    assert replica_counts(Topology.of(gpus(1, 1, 2, 2))) == []
    assert replica_counts(Topology.of(gpus(1, 1, 1))) == [3]
    # a group's links are its own, renumbered from 0
    hw = gpus(1, 1, 1, 1)
    (group,) = first_group(Topology.of(hw), 2).nodes
    assert len(group.gpus) == 2 and group.peer(0, 1).kind == "nvswitch"
    # a link that differs between the groups: GPUs 0-1 on NVLink, 2-3 through the host
    mixed = dataclasses.replace(hw, peers=(PeerLink(0, 1, "nvlink", 100e9),))
    assert replica_counts(Topology.of(mixed)) == [4]


def test_replicas_on_one_node_share_its_dram():
    spec = tiny_spec(n_layers=4)
    hw = gpus(1, 1)
    pp = plan_pipeline(spec, first_group(Topology.of(hw), 2), WL, SOLVE, objective="max")
    cpu = sum(s.plan.memory["cpu_bytes"] for s in pp.stages)
    assert cpu > 0  # the stage keeps something (its workspace) in DRAM
    tight = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, memory_bytes=int(1.5 * cpu)))
    assert replicas_fit_dram(Topology.of(hw), 2, pp.stages)
    assert not replicas_fit_dram(Topology.of(tight), 2, pp.stages)


def test_replicas_side_by_side_on_one_node_each_get_their_share_of_its_cpu():
    # 1 MiB GPUs: the model runs blocks on the CPU, so the CPU's speed shows in the plan. Two
    # replicas of one GPU each: each plans as one GPU beside half the CPU (half its cores, FLOP/s
    # and DRAM bandwidth, every replica busy at once), all of the DRAM's capacity its own to plan
    spec = tiny_spec(n_layers=4)
    hw = gpus(1 / 1024, 1 / 1024)
    cpu = hw.cpu
    half = dataclasses.replace(gpus(1 / 1024), cpu=dataclasses.replace(
        cpu, cores=cpu.cores // 2, mem_bytes_per_s=cpu.mem_bytes_per_s / 2,
        flops_per_s={k: v / 2 for k, v in cpu.flops_per_s.items()}))
    alone = SOLVE(stage_problem(spec, half, WL, 0, 0, 4))
    whole_cpu = SOLVE(stage_problem(spec, gpus(1 / 1024), WL, 0, 0, 4))
    assert alone.predicted["tpot_s"] > whole_cpu.predicted["tpot_s"]   # the CPU matters here
    pp = replicated(spec, Topology.of(hw), 2, WL, SOLVE)
    assert pp.replicas == 2 and len(pp.stages) == 1
    assert pp.stages[0].plan.predicted["tpot_s"] == pytest.approx(alone.predicted["tpot_s"], rel=1e-9)
    assert pp.predicted()["pipelined_decode_tokens_per_s"] == pytest.approx(
        2 * WL.batch / alone.predicted["tpot_s"], rel=1e-9)


def test_replicas_whose_weights_beyond_the_gpus_cannot_share_the_dram_are_refused_before_any_solve():
    spec = tiny_spec(n_layers=4)
    hw = gpus(2 / 1024, 2 / 1024, 2 / 1024, 2 / 1024)
    whole = SOLVE(stage_problem(spec, gpus(1), WL, 0, 0, 4))   # every block's weights and KV, as placed
    need = sum(p["weight_bytes"] + p["kv_bytes"] for p in whole.placement)
    beyond = need - 2 * (2 * 2**20 - hw.gpu_reserve_bytes)   # one replica of 2 GPUs: beyond their HBM
    assert beyond > 0
    for dram, refused in [(1.9 * beyond, True), (None, False)]:
        node = hw if dram is None else dataclasses.replace(
            hw, cpu=dataclasses.replace(hw.cpu, memory_bytes=int(dram) + hw.cpu_reserve_bytes))
        solve = counting(SOLVE)
        if refused:   # two replicas need 2 x beyond in DRAM: refused, nothing solved
            with pytest.raises(InfeasibleError, match="2 replicas of the pipeline do not fit in the DRAM"):
                replicated(spec, Topology.of(node), 2, WL, solve)
            assert solve.calls == 0
        else:
            assert replicated(spec, Topology.of(node), 2, WL, solve).replicas == 2 and solve.calls > 0


def counting(solve):
    """``solve``, counting its calls in ``.calls``."""
    def wrapped(problem):
        wrapped.calls += 1
        return solve(problem)
    wrapped.calls = 0
    return wrapped


@pytest.mark.parametrize("mib, unsolved", [(60, [2, 4]), (80, [2, 4]), (120, [4])])
def test_replica_counts_ruled_out_by_their_bound_are_not_solved_and_the_choice_is_exhaustive(mib, unsolved):
    # 8 layers of ~30 MiB on 4 GPUs of `mib` MiB: one GPU streams most of the model over its 16 GB/s
    # link, four hold it resident. Exhaustive: every replica count solved in full, the best taken
    # (the first strictly fewer seconds per sequence, in the order 1 pipeline, 2, 4 replicas).
    spec = tiny_spec(n_layers=8, hidden=1024, intermediate=4096, n_heads=16, n_kv_heads=8, head_dim=64)
    topo = Topology.of(gpus(*[mib / 1024] * 4))
    whole = plan_pipeline(spec, topo, WL, SOLVE, objective="max")
    candidates = [whole]
    for r in replica_counts(topo):
        pp = replicated(spec, topo, r, WL, SOLVE)
        bound = pipeline_lower_bound(spec, first_group(topo, r), WL, "max")
        assert bound <= pp.objective_s() * (1 + 1e-12)
        candidates.append(pp)
    want = min(candidates, key=lambda pp: pp.seconds_per_sequence())  # min keeps the first of equals
    solve = counting(SOLVE)
    best = best_replicas(spec, topo, whole, solve)
    assert (best.replicas, best.seconds_per_sequence()) == (want.replicas, want.seconds_per_sequence())
    assert [(s.first_layer, s.end_layer) for s in best.stages] == [(s.first_layer, s.end_layer) for s in want.stages]
    # a ruled-out count is worse than the one taken, and costs no solve
    for r in unsolved:
        assert candidates[replica_counts(topo).index(r) + 1].seconds_per_sequence() > best.seconds_per_sequence()
    if unsolved == replica_counts(topo):
        assert solve.calls == 0
    else:
        assert solve.calls > 0


@pytest.mark.parametrize("mib", [60, 120, 1024])
def test_the_batch_search_takes_the_best_batch_of_every_one_solved_and_solves_no_batch_its_bound_rules_out(mib):
    # exhaustive: every batch 1, 2, 4, 8 planned in full; the fewest seconds per sequence wins,
    # the smallest batch of equals; a batch planned only where its bound is below the winner's
    spec = tiny_spec(n_layers=8, hidden=1024, intermediate=4096, n_heads=16, n_kv_heads=8, head_dim=64)
    topo = Topology.of(gpus(*[mib / 1024] * 4))
    req = CompileRequest(model="tiny", hw="tiny", objective="throughput", batch=8, prompt_len=64, gen_len=16,
                         prefill_chunk=64)
    every = {}
    for b in (1, 2, 4, 8):
        try:
            every[b] = plan_pipeline(spec, topo, _workload(req, b), SOLVE, objective="max")
        except InfeasibleError:
            break
    want = min(every, key=lambda b: (every[b].seconds_per_sequence(), b))
    solved = []

    def solve(problem):
        solved.append(problem.workload.batch)
        return SOLVE(problem)

    best, failure = best_batch(spec, topo, req, [1, 2, 4, 8], solve, "max")
    assert failure is None or len(every) < 4
    assert best.workload.batch == want
    assert best.seconds_per_sequence() == every[want].seconds_per_sequence()
    for b in every:
        bound = pipeline_lower_bound(spec, topo, _workload(req, b), "max") / b
        assert bound <= every[b].seconds_per_sequence() * (1 + 1e-12)
        if b not in solved:  # ruled out: its bound, so its pipeline, is above the winner's
            assert bound > best.seconds_per_sequence() and every[b].seconds_per_sequence() > best.seconds_per_sequence()
    assert 8 in solved and set(solved) != set(every)  # at least one batch left unsolved
