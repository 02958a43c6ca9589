"""``hetplan profile`` times quantised weights as the runtime runs them (packed bytes, packed
kernels), plans price quantised compute from those measurements, and a profile that lacks the
plan's quantised dtype is refused with one line saying what to run."""

from __future__ import annotations

import json

import pytest

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.dtypes import row_bytes
from hetplan.errors import HetplanError
from hetplan.frontends.resolve import load_model
from hetplan.graph import block_graph
from hetplan.profile.table import ProfileTable, load_profile, shape_key
from hetplan.runtime.kernels import quant
from hetplan.runtime.kernels.linear import PackedLinear
from hetplan.runtime.profiler import kernels as profile_kernels
from hetplan.runtime.profiler import measure
from hetplan.workload import Workload

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, torch_dtype="float32")
LINEAR_STAGES = ("attn_in", "attn_out", "mlp")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qprofile")
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "config.json").write_text(json.dumps(TINY))
    mp = pytest.MonkeyPatch()
    mp.setattr(profile_kernels, "TOKEN_GRID", (1, 4))
    mp.setattr(profile_kernels, "DECODE_CONTEXTS", (16,))
    mp.setattr(profile_kernels, "PREFILL_PROMPTS", (8,))
    mp.setattr(profile_kernels, "LINEAR_GRID", ((64, 96),))
    mp.setattr(profile_kernels, "LINEAR_TOKENS", (1,))
    # Nominal peaks, no overhead run and 3 repeats a point: a budget no load can exhaust goes to
    # the kernels this file is about, and takes only what they need.
    mp.setattr(measure, "_device_peaks", _nominal_peaks)
    mp.setattr(measure, "_cpu_task_overhead_s", lambda budget: 0.0)
    mp.setattr(measure, "MAX_REPEATS", measure.MIN_REPEATS)
    try:
        rc = main(["profile", "--budget", "600s", "--out", str(tmp / "node.yaml"), "--model", str(tmp / "tiny"),
                   "--weight-dtype", "q4_0"])
    finally:
        mp.undo()
    assert rc == 0
    return tmp


def _nominal_peaks(device, peaks, rates, budget, tick) -> list:
    peaks.update({"cpu.mem_bandwidth": 10e9, "cpu.flops.fp32": 50e9, "latency.cpu_task": 1e-6})
    rates.update({("cpu", "mem"): 10e9, ("cpu", "fp32"): 50e9})
    return ["fp32"]


def test_quantised_stages_are_measured_at_the_planners_packed_bytes(profiled):
    table = load_profile(profiled / "node.profile.json")
    spec = load_model(str(profiled / "tiny")).with_dtypes(weight_dtype="q4_0")
    for op in LINEAR_STAGES:
        entry = table.entries[("cpu", op, "q4_0", shape_key(op, spec))]
        for p in entry.points:
            graph = block_graph(spec, Workload(batch=int(p.x), prompt_len=1, gen_len=1))
            work = next(st.work for st in graph.stages["decode"] if st.kind == op)
            assert p.bytes == pytest.approx(work.bytes) and p.flops == pytest.approx(work.flops)
    fp32 = load_model(str(profiled / "tiny"))
    entry32 = table.entries[("cpu", "mlp", "fp32", shape_key("mlp", fp32))]
    # 18 B per 32 weights against 128: the q4_0 points count the packed bytes, not fp32's
    assert table.entries[("cpu", "mlp", "q4_0", shape_key("mlp", spec))].points[0].bytes \
        < entry32.points[0].bytes / 5


def test_a_quantised_plan_prices_its_linear_stages_from_the_profile(profiled):
    table = load_profile(profiled / "node.profile.json")
    spec = load_model(str(profiled / "tiny")).with_dtypes(weight_dtype="q4_0")
    plan, _ = compile_plan(CompileRequest(model=str(profiled / "tiny"), hw=str(profiled / "node.yaml"),
                                          prompt_len=4, gen_len=2, weight_dtype="q4_0"))
    decode = [t for t in plan.schedule["decode"].tasks if t.kind in LINEAR_STAGES]
    assert decode and {t.cost_source for t in decode} == {"profile"}
    for t in decode:
        assert t.duration_s == pytest.approx(table.entries[("cpu", t.kind, "q4_0", shape_key(t.kind, spec))].at(1))


def test_grid_and_stage_kernels_multiply_packed_bytes(monkeypatch):
    monkeypatch.setattr(profile_kernels, "LINEAR_GRID", ((64, 96),))
    monkeypatch.setattr(profile_kernels, "LINEAR_TOKENS", (1,))
    for fmt in quant.FORMATS:
        (k,) = profile_kernels.linear_kernels("cpu", fmt)
        cache = {}
        k.setup(cache)
        w = cache["w"][0]
        assert isinstance(w, PackedLinear) and w.fmt == fmt and w.shape == (96, 64)
        assert sum(a.numel() * a.element_size() for a in w.segments[0]) == quant.nbytes(fmt, (96, 64))
        assert k.work.bytes == row_bytes(fmt, 64) * 96 + (64 + 96) * 4
    spec = load_model_dict(TINY).with_dtypes(weight_dtype="q8_0")
    mlp = next(k for k in profile_kernels.stage_kernels(spec, "cpu") if k.op == "mlp")
    cache = {}
    mlp.setup(cache)
    (weights,) = {key: v for key, v in cache.items() if key[0] == "w"}.values()
    assert all(isinstance(weights[0][name], PackedLinear) for name in ("gate_up", "down"))


def load_model_dict(config: dict):
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        return load_model(d)


def test_a_profile_lacking_the_plans_quantised_dtype_is_refused(profiled, tmp_path, capsys):
    raw = json.loads((profiled / "node.profile.json").read_text())
    raw["entries"] = [e for e in raw["entries"] if e["dtype"] != "q4_0"]
    (tmp_path / "node.profile.json").write_text(json.dumps(raw))
    node = (profiled / "node.yaml").read_text().replace("node.profile.json", str(tmp_path / "node.profile.json"))
    (tmp_path / "node.yaml").write_text(node)
    rc = main(["compile", str(profiled / "tiny"), "--hw", str(tmp_path / "node.yaml"), "--weight-dtype", "q4_0",
               "--prompt-len", "4", "--gen-len", "2", "-o", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "no measurement of q4_0 weights on the cpu" in err
    assert "hetplan profile --model MODEL --weight-dtype q4_0" in err
    assert not (tmp_path / "plan.json").exists()


def test_a_table_that_never_measured_the_device_leaves_it_to_the_roofline():
    spec = load_model_dict(TINY).with_dtypes(weight_dtype="q4_0")
    graph = block_graph(spec, Workload(batch=1, prompt_len=1, gen_len=1))
    work = next(st.work for st in graph.stages["decode"] if st.kind == "mlp")
    empty = ProfileTable(entries={}, machine={}, transfers={}, info={})
    assert empty.seconds("cpu", work, spec) is None
    with_fp32 = ProfileTable.from_dict({"schema_version": 1, "entries": [
        {"device": "cpu", "op": "linear", "dtype": "fp32", "shape": "64x96",
         "points": [{"x": 1.0, "seconds": 1e-5, "flops": 1.0, "bytes": 1.0}]}]})
    with pytest.raises(HetplanError, match="no measurement of q4_0"):
        with_fp32.seconds("cpu", work, spec)


def test_weight_dtype_needs_a_model(tmp_path, capsys):
    rc = main(["profile", "--budget", "1s", "--out", str(tmp_path / "node.yaml"), "--weight-dtype", "q4_0"])
    assert rc == 2 and "--weight-dtype" in capsys.readouterr().err
    assert not (tmp_path / "node.yaml").exists()
