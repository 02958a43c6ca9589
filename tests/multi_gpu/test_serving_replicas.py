"""``compile --serve`` on several GPUs weighs replicas: a tiny llama (4 layers, hidden 64, fp32,
~0.5 MB) on nodes of 2 and 4 alike 64 MiB GPUs, which each hold it, is served by one replica per
GPU, each replica exactly the plan compiled for one GPU alone (the oracle: the public compile on
a node.yaml with that GPU only), the whole serving r times its throughput; the DRAM pool of
replicas on one node is each one's share of it (hand formula of ``pools``); GPUs too small for
the model (``--gpu-mem``), with a TPOT SLO that only a pipeline over both meets, get one replica of a 2-stage
pipeline; GPUs that are not alike never get replicas; ``show`` and ``check`` take the plan."""

from __future__ import annotations

import pytest

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.plan import load_plan
from hetplan.serving import ServingRequest, compile_serving
from tests.distributed.pipelines import save_llama
from tests.test_cli import hetplan

GPU = "{name: g, memory: %s, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}"


def node(gpus: list, cpu_memory: str = "256MiB") -> str:
    return "\n".join([
        "name: tiny-gpus", "gpus:", *[f"  - {GPU % m}" for m in gpus],
        f"cpu: {{name: cpu, cores: 2, memory: {cpu_memory}, mem_bandwidth: 20GB/s, flops: {{fp32: 2GFLOPS}}}}",
        "links: {h2d: 10GB/s, d2h: 10GB/s}", "peers: [{between: all, kind: pcie, bandwidth: 10GB/s}]",
        "reserve: {gpu: 1KiB, cpu: 1KiB}", "latency: {gpu_task: 1.0e-6, cpu_task: 1.0e-6, link_task: 1.0e-6}", ""])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-replicas")
    save_llama(d / "llama")
    paths = {}
    for name, gpus in {"one": ["64MiB"], "two": ["64MiB"] * 2, "four": ["64MiB"] * 4, "unlike": ["64MiB", "48MiB"]}.items():
        paths[name] = d / f"{name}.yaml"
        paths[name].write_text(node(gpus))
    return d / "llama", paths


def request(files, hw: str, **kw) -> CompileRequest:
    model, paths = files
    return CompileRequest(model=str(model), hw=str(paths[hw]), weight_dtype="fp32", prompt_len=16, gen_len=8, **kw)


SERVE = ServingRequest(max_batch=8, max_context=4096)


@pytest.mark.parametrize("hw, r", [("two", 2), ("four", 4)])
def test_alike_gpus_each_holding_the_model_serve_one_replica_each_at_r_times_one_gpus_throughput(files, hw, r):
    plan, _ = compile_serving(request(files, hw), SERVE)
    alone, _ = compile_serving(request(files, "one"), SERVE)   # the oracle: one GPU alone
    pp = plan.pipeline
    assert pp["replicas"] == r and pp["replica_step"] == {"gpus": 1} and len(pp["stages"]) == 1
    assert plan.serving["batch"] == alone.serving["batch"] == plan.workload.batch
    # each replica is the one-GPU plan: the same times, so r times its throughput at the same batch
    assert pp["predicted"]["tpot_s"] == pytest.approx(alone.predicted["tpot_s"], rel=1e-12)
    assert pp["predicted"]["ttft_s"] == pytest.approx(alone.predicted["ttft_s"], rel=1e-12)
    assert pp["predicted"]["decode_tokens_per_s"] == pytest.approx(r * alone.predicted["decode_tokens_per_s"],
                                                                   rel=1e-12)
    total = r * plan.workload.batch * plan.workload.gen_len / pp["predicted"]["latency_s"]
    assert total == pytest.approx(r * alone.predicted["throughput_tokens_per_s"], rel=1e-12)
    # the curve is one replica's: the oracle's, point by point
    for mine, its in zip(plan.serving["curve"], alone.serving["curve"], strict=True):
        assert mine == pytest.approx(its, rel=1e-12)
    assert plan.serving["gpu_blocks"] == alone.serving["gpu_blocks"]


def test_replicas_on_one_node_share_its_dram_pool(files):
    """Each of r replicas gets ``min((budget / r - used + kv) // t, N C)`` DRAM tokens (the pools'
    formula over its share); 256 MiB of DRAM binds below the cap of 64 x 4096 positions."""
    for hw, r in (("one", 1), ("two", 2), ("four", 4)):
        plan, _ = compile_serving(request(files, hw), ServingRequest(max_batch=64, max_context=4096))
        m, sv, spec = plan.memory, plan.serving, plan.model
        t = spec.n_layers * spec.kv_bytes_per_token()
        budget = 256 * 2**20 - 1024
        tokens = min(int((budget / r - m["cpu_bytes"] + m["breakdown"]["cpu"]["kv"]) // t), 64 * 4096)
        assert tokens < 64 * 4096
        assert sv["cpu_blocks"] == tokens // sv["block_tokens"], hw


def test_gpus_too_small_with_a_tpot_slo_only_a_pipeline_meets_get_one_replica_of_a_pipeline(files):
    small = {"gpu_mem": "400KiB"}                                  # --gpu-mem: less than the model's weights
    pipe, _ = compile_plan(request(files, "two", **small))        # one pipeline over both GPUs
    single, _ = compile_plan(request(files, "one", **small))      # one GPU alone, streaming what it cannot hold
    assert len(pipe.pipeline["stages"]) == 2
    fast, slow = pipe.pipeline["predicted"]["tpot_s"], single.predicted["tpot_s"]
    assert fast < slow
    slo = (fast * slow) ** 0.5
    plan, _ = compile_serving(request(files, "two", **small), ServingRequest(max_batch=8, slo_tpot_s=slo))
    assert (plan.pipeline.get("replicas") or 1) == 1 and len(plan.pipeline["stages"]) == 2
    assert plan.serving["curve"][0]["tpot_s"] == pytest.approx(fast, rel=1e-9)   # the pipeline's, stage after stage


def test_gpus_that_are_not_alike_never_get_replicas(files):
    plan, _ = compile_serving(request(files, "unlike"), SERVE)
    assert "replicas" not in plan.pipeline and plan.serving is not None


def test_compile_show_and_check_take_a_replicas_serving_plan(files, tmp_path):
    model, paths = files
    out = tmp_path / "plan.json"
    proc = hetplan("compile", model, "--hw", paths["two"], "--weight-dtype", "fp32", "--prompt-len", 16,
                   "--gen-len", 8, "--serve", "--max-batch", 8, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "2 replicas of a pipeline over 1 device(s) each" in proc.stdout
    assert "serving: 2 replicas, each: running batch <= 8" in proc.stdout
    plan = load_plan(out)
    assert plan.pipeline["replicas"] == 2
    shown = hetplan("show", out)
    assert shown.returncode == 0 and "2 replicas, each with its own engine" in shown.stdout
    checked = hetplan("check", out)
    assert checked.returncode == 0 and "identical" in checked.stdout, checked.stdout + checked.stderr


@pytest.mark.parametrize("hw, gpu_mem, tight", [("four", None, False), ("four", None, True), ("two", "1MiB", True)])
def test_the_bounded_search_chooses_what_compiling_every_candidate_chooses(monkeypatch, files, hw, gpu_mem, tight):
    """Every (replicas, batch) compiled one by one through the public compile, the winner chosen by
    the rule the module states (most total throughput within the SLOs; fewer replicas, then the
    smaller batch, on a tie), against ``compile_serving``, which skips the candidates its
    throughput bound rules out; the bound is above the throughput of every candidate. ``tight``:
    a TPOT SLO that half the candidates miss (the fastest half's slowest TPOT), so that the
    candidates of highest bound are compiled and fail it."""
    import dataclasses

    from hetplan.compiler import load_machine
    from hetplan.errors import InfeasibleError
    from hetplan.pipeline.topology import Topology
    from hetplan.serving import decide

    req = request(files, hw, gpu_mem=gpu_mem)
    upper = decide.ThroughputBound(req, Topology.of(load_machine(req)))
    every = {}
    for r in decide.replica_options(req):
        for b in (1, 2, 4, 8):
            try:
                plan, _ = compile_plan(dataclasses.replace(req, batch=b, objective="latency", replicas=r, notes=[]))
            except InfeasibleError:
                break
            t = decide.replica_times(plan)
            assert r * t["throughput_tokens_per_s"] <= upper(r, b) * (1 + 1e-9)
            every[r, b] = (r * t["throughput_tokens_per_s"], t["tpot_s"])
    tpots = sorted(tpot for _, tpot in every.values())
    slo = tpots[(len(tpots) - 1) // 2] if tight else None
    found = {rb: total for rb, (total, tpot) in every.items() if slo is None or tpot <= slo}
    r, b = max(found, key=lambda rb: (found[rb], -rb[0], -rb[1]))
    compiled = []
    real = decide.compile_plan
    monkeypatch.setattr(decide, "compile_plan", lambda one: compiled.append((one.replicas, one.batch)) or real(one))
    plan, _ = compile_serving(req, ServingRequest(max_batch=8, max_context=256, slo_tpot_s=slo))
    assert (decide.replicas_of(plan), plan.workload.batch) == (r, b)
    assert decide.replicas_of(plan) * decide.replica_times(plan)["throughput_tokens_per_s"] == \
        pytest.approx(found[r, b], rel=1e-12)
    assert len(compiled) < len(every)   # the bound spared some compiles
    if tight:
        assert len(found) < len(every)


def test_a_serving_search_builds_each_stage_bound_once(monkeypatch, files):
    """``ThroughputBound`` over every replica count and the candidates' own stage searches share
    one ``StageBound`` per (model, workload, device description): none is built twice, and the
    plan's pipeline is the one its candidate compiled alone (no memo) has."""
    import dataclasses
    import json

    from hetplan.pipeline import plan as pipeline_plan
    from hetplan.serving.decide import replicas_of as decide_replicas

    real = pipeline_plan.StageBound
    built = []

    def counted(spec, hw, wl):
        built.append((json.dumps(spec.to_dict(), sort_keys=True), json.dumps(hw.to_dict(), sort_keys=True), wl))
        return real(spec, hw, wl)
    req = request(files, "four", gpu_mem="1MiB")   # no GPU holds the model: pipelines of several stages
    sreq = ServingRequest(max_batch=8, max_context=128)
    alone, _ = compile_serving(req, sreq)
    monkeypatch.setattr(pipeline_plan, "StageBound", counted)
    monkeypatch.setenv("HETPLAN_JOBS", "1")   # every StageBound built in this process, where it is counted
    plan, _ = compile_serving(req, sreq)
    assert len(built) > 1 and len(set(built)) == len(built)
    assert {wl.batch for _, _, wl in built} == set(range(1, 9)) & {1, 2, 4, 8}
    assert plan.pipeline == alone.pipeline and plan.serving == alone.serving
    one = dataclasses.replace(req, batch=plan.workload.batch, objective="latency",
                              replicas=decide_replicas(plan), notes=[])
    assert compile_plan(one)[0].pipeline["predicted"] == plan.pipeline["predicted"]


def test_the_bounds_of_every_candidate_computed_side_by_side_are_those_computed_one_by_one(monkeypatch, files):
    """``ThroughputBound.every`` bounds the batches in forked children: the same bounds as asking
    for each candidate in turn, and the StageBounds the children built come back to the memo, so
    asking again builds none."""
    from hetplan.compiler import load_machine
    from hetplan.pipeline import plan as pipeline_plan
    from hetplan.pipeline.topology import Topology
    from hetplan.serving import decide

    req = request(files, "four", gpu_mem="1MiB")
    topo = Topology.of(load_machine(req))
    options, batches = decide.replica_options(req), [1, 2, 4, 8]
    assert len(options) > 1
    one_by_one = {(r, b): decide.ThroughputBound(req, topo)(r, b) for r in options for b in batches}
    monkeypatch.setenv("HETPLAN_JOBS", "2")
    upper = decide.ThroughputBound(req, topo)
    assert upper.every(options, batches) == one_by_one
    real, built = pipeline_plan.StageBound, []
    monkeypatch.setattr(pipeline_plan, "StageBound", lambda *a: built.append(a) or real(*a))
    assert {(r, b): upper(r, b) for r in options for b in batches} == one_by_one
    assert built == []
