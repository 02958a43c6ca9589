"""Profiles with impossible values are refused, naming the value; a profile measured on another
machine is flagged with a warning naming the difference."""

import json
import warnings

import pytest

from hetplan.cli import profile as cli_profile
from hetplan.errors import HetplanError
from hetplan.profile.checks import current_machine, machine_differences, peak_problems, physical_limits
from hetplan.profile.table import ProfileMismatchWarning, ProfileTable, load_profile

TWO_CORES = {"cpu_model": "Test CPU", "cpu_count": 2, "memory_bytes": 16 << 30, "gpus": []}


def write_profile(path, machine, points=((1, 1e-3),), peaks=None):
    path.write_text(json.dumps({
        "schema_version": 1, "machine": machine, "info": {"peaks": peaks or {}},
        "entries": [{"device": "cpu", "op": "mlp", "dtype": "fp32", "shape": "d64_f128_silu_gated",
                     "points": [{"x": x, "seconds": s, "flops": 1e3, "bytes": 1e3} for x, s in points]}]}))
    return path


def test_zero_or_negative_time_is_refused_naming_the_entry(tmp_path):
    for bad in (0.0, -1e-3):
        p = write_profile(tmp_path / "p.json", current_machine(), points=((1, 1e-3), (4, bad)))
        with pytest.raises(HetplanError, match=r"entry \(cpu, mlp, fp32, d64_f128_silu_gated\) at x=4: seconds"):
            load_profile(p)


def test_zero_and_negative_peaks_are_refused_by_name():
    problems = peak_problems({"cpu.mem_bandwidth": 0.0, "cpu.flops.fp32": -5.0, "latency.cpu_task": 2e-6},
                             TWO_CORES)
    assert len(problems) == 2
    assert any(p.startswith("cpu.mem_bandwidth = 0.0") for p in problems)
    assert any(p.startswith("cpu.flops.fp32 = -5.0") for p in problems)


def test_bandwidth_above_the_physical_peak_is_refused():
    # Two cores can load at most 2 x 768 GB/s; a 2 TB/s "DRAM bandwidth" is a measuring error.
    assert physical_limits(TWO_CORES)["cpu.mem_bandwidth"] == pytest.approx(2 * 768e9)
    (problem,) = peak_problems({"cpu.mem_bandwidth": 2e12}, TWO_CORES)
    assert "cpu.mem_bandwidth" in problem and "above the physical peak" in problem
    # A PCIe 4.0 x16 link (16 GT/s * 16 lanes * 128/130 / 8 = 31.5 GB/s) cannot carry 50 GB/s.
    gen4 = dict(TWO_CORES, gpus=[{"name": "G", "link_peak_bytes_per_s": 16e9 * 16 * 128 / 130 / 8}])
    (problem,) = peak_problems({"links.h2d": 50e9, "links.d2h": 25e9}, gen4)
    assert problem.startswith("links.h2d = 5e+10 is above the physical peak 3.151e+10")


def test_a_time_faster_than_the_cpu_can_compute_is_refused(tmp_path):
    # 1e15 FLOPs in 1 ms on two cores is 1 PFLOP/s: impossible for fp32 (2 * 6 GHz * 64 = 768 GFLOP/s).
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"schema_version": 1, "machine": TWO_CORES, "entries": [
        {"device": "cpu", "op": "linear", "dtype": "fp32", "shape": "4x4",
         "points": [{"x": 1, "seconds": 1e-3, "flops": 1e15, "bytes": 1.0}]}]}))
    with pytest.raises(HetplanError, match="FLOP/s is above the physical peak"):
        load_profile(p, check_machine=False)


def test_quantised_weights_are_held_to_the_int8_ceiling_not_fp32s(tmp_path):
    # A q4_0 GEMM multiplied in int8 (AVX-512 VNNI) at 1 TFLOP/s on two cores is above fp32's
    # 768 GFLOP/s but possible; 50 TFLOP/s is above 2 cores * 6 GHz * 4096 = 49.2 TFLOP/s.
    assert physical_limits(TWO_CORES)["cpu.flops.q4_0"] == pytest.approx(2 * 6e9 * 4096)
    for flops, ok in ((1e12, True), (5e13, False)):
        p = tmp_path / "p.json"
        p.write_text(json.dumps({"schema_version": 1, "machine": TWO_CORES, "entries": [
            {"device": "cpu", "op": "mlp", "dtype": "q4_0", "shape": "d64_f128_silu_gated",
             "points": [{"x": 512, "seconds": 1.0, "flops": flops, "bytes": 1.0}]}]}))
        if ok:
            load_profile(p, check_machine=False)
        else:
            with pytest.raises(HetplanError, match="q4_0.*FLOP/s is above the physical peak 4.915e"):
                load_profile(p, check_machine=False)


def test_profiler_refuses_to_write_impossible_measurements(tmp_path, monkeypatch):
    from hetplan.runtime import profiler

    bad = profiler.ProfileResult(peaks={"cpu.mem_bandwidth": 9e15, "cpu.flops.fp32": 1e11, "latency.cpu_task": 1e-6},
                                 machine=TWO_CORES,
                                 table=ProfileTable(entries={}, machine=TWO_CORES, transfers={}, info={}))
    monkeypatch.setattr(profiler, "profile_machine", lambda *a, **k: bad)
    with pytest.raises(HetplanError, match=r"refusing to write .*node.yaml.*cpu.mem_bandwidth = 9e\+15"):
        cli_profile.measure(str(tmp_path / "node.yaml"), 1.0, ())
    assert not list(tmp_path.iterdir())


def test_profile_from_another_machine_warns_naming_the_difference(tmp_path):
    here = current_machine()
    other = dict(here, cpu_model="Imaginary CPU 9000", memory_bytes=4 * (here["memory_bytes"] or 1 << 30))
    p = write_profile(tmp_path / "p.json", other)
    with pytest.warns(ProfileMismatchWarning) as caught:
        load_profile(p)
    msg = str(caught[0].message)
    assert "CPU model: profile 'Imaginary CPU 9000'" in msg and repr(here["cpu_model"]) in msg
    assert "memory: profile" in msg


def test_profile_from_this_machine_loads_silently(tmp_path):
    p = write_profile(tmp_path / "p.json", current_machine())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(p)


def test_machine_differences_name_cpus_memory_and_gpus():
    a = {"cpu_model": "X", "cpu_count": 16, "memory_bytes": 128 << 30,
         "gpus": [{"name": "NVIDIA H200", "memory_bytes": 141 << 30}]}
    assert machine_differences(a, dict(a)) == []
    assert machine_differences(a, dict(a, memory_bytes=int((128 << 30) * 0.97))) == []
    diffs = machine_differences(a, dict(a, cpu_count=2, gpus=[]))
    assert diffs == ["CPUs: profile 16, this machine 2", "GPUs: profile [NVIDIA H200], this machine [none]"]
    smaller = dict(a, gpus=[{"name": "nvidia h200", "memory_bytes": 80 << 30}])
    assert machine_differences(a, smaller) == ["GPU 0 memory: profile 141.00 GiB, this machine 80.00 GiB"]


def test_unreadable_profiles_are_errors_that_say_what_to_do(tmp_path):
    with pytest.raises(HetplanError, match="no such profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(HetplanError, match="malformed JSON"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "v9.json").write_text(json.dumps({"schema_version": 9}))
    with pytest.raises(HetplanError, match="schema_version 9"):
        load_profile(tmp_path / "v9.json")


def test_compile_with_a_foreign_profile_prints_a_one_line_warning(tmp_path, capsys):
    from hetplan.cli import main

    other = dict(current_machine(), cpu_model="Imaginary CPU 9000")
    write_profile(tmp_path / "node.profile.json", other)
    (tmp_path / "node.yaml").write_text(
        "name: box\ncpu: {name: c, cores: 2, memory: 16GiB, mem_bandwidth: 10GB/s, flops: {fp32: 100GFLOPS}}\n"
        "profile: node.profile.json\n")
    assert main(["compile", "gpt2", "--hw", str(tmp_path / "node.yaml"), "--prompt-len", "4", "--gen-len", "2",
                 "-o", str(tmp_path / "plan.json")]) == 0
    err = capsys.readouterr().err
    assert "hetplan: warning: " in err and "CPU model: profile 'Imaginary CPU 9000'" in err
    assert "Traceback" not in err and "warnings.warn" not in err


def test_budget_is_read_in_seconds_or_minutes_and_nonsense_is_refused(capsys):
    from hetplan.cli import main

    assert cli_profile.parse_budget("120s") == 120.0
    assert cli_profile.parse_budget("2m") == 120.0
    assert cli_profile.parse_budget("90") == 90.0
    for bad in ("soon", "0s", "-5s"):
        assert main(["profile", "--budget", bad]) == 2
        assert "--budget: cannot read" in capsys.readouterr().err


def test_a_profile_whose_read_bandwidth_moved_says_so():
    from hetplan.cli.profile import drift_note
    assert drift_note(40e9, 44e9) is None and drift_note(40e9, 32.5e9) is None    # within 20 %
    assert drift_note(40e9, None) is None and drift_note(None, 40e9) is None
    note = drift_note(40e9, 25e9)
    assert note.startswith("note: the CPU's streaming read was 40.0 GB/s when profiling started and 25.0 GB/s")
    assert "re-run `hetplan profile`" in note and drift_note(20e9, 30e9) is not None
