"""``hetplan serve`` runs a serving plan's streamed blocks as planned: their weights stay in host
memory and are copied into the staging slot their plan's ``load`` names, ahead of use, and they
compute on the (emulated) GPU with that slot's views. Each request's greedy output equals
``hetplan exec``'s for its prompt alone; a slot is never refilled before the block reading it has
computed, and with two slots the next block's copy runs while the block before computes; the
slots are the plan's staging bytes; the GPU peak stays within the plan (the
autouse check of ``tests/serve/conftest.py``, and asserted here).

The machine makes streaming pay: DRAM and the link are fast (20 GB/s, 10 GB/s) and the CPU
computes slowly (2 GFLOP/s), so a GPU budget too small for every block makes the planner copy
some of them in rather than compute them on the CPU. Two plans: the ILP under 250 KiB (some
blocks resident, the rest streamed through one slot) and the FlexGen-style ``stream`` strategy
under 320 KiB (every block after the embedding streamed through two slots).
"""

from __future__ import annotations

import threading

import pytest
import torch

from hetplan.compiler import CompileRequest
from hetplan.graph import PHASES
from hetplan.runtime.serve.load import load_engine
from hetplan.runtime.serve.sampling import SamplingParams
from hetplan.runtime.serve.settings import settings_for
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.runtime.staging import streamed_slots
from hetplan.serving import ServingRequest, compile_serving
from tests.exec.test_numerics import save_tiny_model
from tests.serve.conftest import planned_gpu_bytes
from tests.serve.fixtures import engine_for, random_prompt

STREAM_NODE = """
name: fast-dram-slow-cpu
gpus: [{name: test gpu, memory: 1GiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}]
cpu: {name: slow cpu, cores: 2, memory: 4GiB, mem_bandwidth: 20GB/s, flops: {fp32: 2GFLOPS}}
links: {h2d: 10GB/s, d2h: 10GB/s}
reserve: {gpu: 1KiB, cpu: 1KiB}
latency: {gpu_task: 1.0e-6, cpu_task: 1.0e-6, link_task: 1.0e-6}
"""
PLANS = {"ilp-one-slot": ("ilp", "250KiB", 1), "stream-two-slots": ("stream", "320KiB", 2)}
"""name -> (strategy, GPU budget, staging depth the plan is expected to have)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-stream")
    save_tiny_model("llama", d)
    (d / "node.yaml").write_text(STREAM_NODE)
    return d


def compiled(checkpoint, name: str):
    """(serving plan ``PLANS[name]``, checkpoint directory)."""
    strategy, gpu_mem, depth = PLANS[name]
    req = CompileRequest(model=str(checkpoint), hw=str(checkpoint / "node.yaml"), strategy=strategy,
                         weight_dtype="fp32", gpu_mem=gpu_mem, prompt_len=24, gen_len=24)
    plan, _ = compile_serving(req, ServingRequest(max_batch=4))
    assert plan.staging["depth"] == depth
    return plan, str(checkpoint)


@pytest.fixture(scope="module", params=sorted(PLANS))
def streamed(request, checkpoint):
    return compiled(checkpoint, request.param)


def spy_stages(engine, monkeypatch) -> list:
    """[(block, device, {storage pointers of its weights})] of every stage the engine runs."""
    calls, real = [], engine.model.backend.run

    def run(call):
        ptrs = {t.untyped_storage().data_ptr() for t in call.weights.values() if isinstance(t, torch.Tensor)}
        calls.append((call.block, call.device, ptrs))
        return real(call)

    monkeypatch.setattr(engine.model.backend, "run", run)
    return calls


def test_streamed_blocks_compute_on_the_gpu_from_their_slots_and_match_exec_alone(streamed, monkeypatch):
    plan, directory = streamed
    names = {p["block"]: p["weights"] for p in plan.placement}
    assert "stream" in names.values()
    engine = engine_for(plan, directory)   # the serving plan's own pools, batch and block size
    model = engine.model
    calls = spy_stages(engine, monkeypatch)
    prompts = [random_prompt(60 + i, n) for i, n in enumerate((6, 13, 3))]
    reqs = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
    engine.run_until_idle()
    for p, r in zip(prompts, reqs):
        alone = run_plan(plan, RunOptions(weights=directory, prompt_ids=(tuple(p),), gen_len=12, emulate=True,
                                          warmup=False))
        assert r.generated == alone.tokens[0]

    gpu = model.devices.device("gpu")
    slot_ptr = [s.untyped_storage().data_ptr() for s in model.residency.slots]
    for phase in PHASES:
        for block, slot in streamed_slots(plan, phase).items():
            assert names[block] == "stream"
            seen = [(dev, ptrs) for b, dev, ptrs in calls if b == block and ptrs]
            assert seen and all(dev == gpu and ptrs == {slot_ptr[slot]} for dev, ptrs in seen), block
    for block, where in names.items():
        if where == "gpu":  # resident blocks compute on their own GPU buffer
            own = model.residency.blocks[block].flat.untyped_storage().data_ptr()
            assert all(ptrs == {own} for b, _, ptrs in calls if b == block and ptrs), block

    # the staging ring is the plan's: depth slots of the largest streamed block
    assert len(model.residency.slots) == plan.staging["depth"]
    assert all(s.numel() * s.element_size() == plan.staging["slot_bytes"] for s in model.residency.slots)
    assert model.devices.peak_bytes()["gpu"] <= planned_gpu_bytes(engine)
    alloc = engine.pool.alloc
    assert not alloc.tables and all(alloc.free_blocks(t) == alloc.n_blocks[t] for t in alloc.n_blocks)


def test_a_slot_is_refilled_only_after_the_block_reading_it_has_computed(streamed, monkeypatch):
    """Copies (on the emulated copy lane's thread) and stages (on the engine's) logged as they
    start and end: each streamed block's copy ends before its first stage starts, and a copy into
    a slot starts only after the last stage of the block that slot held before."""
    plan, directory = streamed
    engine = engine_for(plan, directory)
    model = engine.model
    log, lock = [], threading.Lock()

    def note(*event):
        with lock:
            log.append(event)

    real_load, real_run = model.residency.load, model.backend.run

    def load(block, slot):
        note("load", "start", block, slot)
        real_load(block, slot)
        note("load", "end", block, slot)

    def run(call):
        note("stage", "start", call.block)
        out = real_run(call)
        note("stage", "end", call.block)
        return out

    monkeypatch.setattr(model.residency, "load", load)
    monkeypatch.setattr(model.backend, "run", run)
    for i, n in enumerate((9, 2)):
        engine.submit(random_prompt(80 + i, n), SamplingParams(max_tokens=6, temperature=0.0))
    engine.run_until_idle()

    slot_of = streamed_slots(plan, "decode")
    assert streamed_slots(plan, "prefill") == slot_of
    assert sum(e[:2] == ("load", "end") for e in log) >= 2 * len(slot_of)
    holder, arrived = {}, set()   # slot -> block last copied into it; blocks whose copy has ended
    for kind, when, block, *slot in log:
        if kind == "load":
            if when == "start":
                holder[slot[0]] = block
                arrived.discard(block)
            else:
                arrived.add(block)
        elif block in slot_of:
            assert holder.get(slot_of[block]) == block, f"slot {slot_of[block]} refilled while {block} reads it"
            assert block in arrived, f"a stage of {block} {when}s before its weights arrived"


def test_with_two_slots_the_next_blocks_copy_runs_while_the_block_before_computes(checkpoint, monkeypatch):
    """Double buffering: the first streamed block's stages wait until the second block's copy
    has begun (a copy issued only once the first block was done would never begin, and the
    wait would time out)."""
    plan, directory = compiled(checkpoint, "stream-two-slots")
    engine = engine_for(plan, directory)
    model = engine.model
    first, second = (b for b, _ in model.streamed["prefill"][:2])
    copying = threading.Event()
    real_load, real_run = model.residency.load, model.backend.run

    def load(block, slot):
        if block == second:
            copying.set()
        real_load(block, slot)

    def run(call):
        if call.block == first:
            assert copying.wait(timeout=60), f"{second}'s copy had not begun while {first} computed"
        return real_run(call)

    monkeypatch.setattr(model.residency, "load", load)
    monkeypatch.setattr(model.backend, "run", run)
    req = engine.submit(random_prompt(90, 5), SamplingParams(max_tokens=1, temperature=0.0))
    engine.run_until_idle()
    assert copying.is_set() and req.finish_reason == "length"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_blocks_on_a_cuda_gpu_come_from_pinned_memory_and_match_exec_alone(streamed):
    """On a real GPU the copies run on the h2d stream out of page-locked host memory."""
    plan, directory = streamed
    engine = load_engine(plan, directory, settings_for(plan), emulate=False)
    model = engine.model
    assert model.devices.mode == "cuda"
    for block in streamed_slots(plan, "decode"):
        host = model.residency.blocks[block].flat
        assert host.device.type == "cpu" and host.is_pinned()
    prompts = [random_prompt(60 + i, n) for i, n in enumerate((6, 13, 3))]
    reqs = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
    engine.run_until_idle()
    model.close()
    for p, r in zip(prompts, reqs):
        alone = run_plan(plan, RunOptions(weights=directory, prompt_ids=(tuple(p),), gen_len=12, emulate=False,
                                          warmup=False))
        assert r.generated == alone.tokens[0]
