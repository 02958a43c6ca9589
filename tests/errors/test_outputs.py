"""The one writer, honest exits and the messages around them."""

from __future__ import annotations

import os
import re
import signal
import stat
import sys

import pytest

from hetplan import progress
from hetplan.errors import HetplanError
from hetplan.files import write_atomic
from tests.errors.workdir import NODE, populate, run


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_an_existing_file_keeps_its_mode_and_a_new_one_gets_the_umask_mode(tmp_path):
    old = tmp_path / "old.json"
    old.write_text("x")
    old.chmod(0o600)
    write_atomic(old, "y")
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.png", b"\x89PNG")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.png").stat().st_mode) == 0o644


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_something_that_is_not_a_regular_file_is_never_replaced(tmp_path, kind):
    p = tmp_path / "x"
    p.mkdir() if kind == "dir" else os.mkfifo(p)
    with pytest.raises(HetplanError, match="hetplan writes only regular files"):
        write_atomic(p, "data")
    assert (p.is_dir() if kind == "dir" else stat.S_ISFIFO(p.stat().st_mode))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["x"]  # no temporary file left


def test_ctrl_c_inside_an_interruptible_block_sets_the_flag_then_interrupts():
    # as a terminal starts Python (a shell that backgrounds pytest hands it SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with progress.interruptible() as flag:
                os.kill(os.getpid(), signal.SIGINT)
                assert flag.requested
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_exec_without_torch_names_both_install_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    code, _, err = run(["exec", "plan.json", "--weights", "random"], capsys)
    assert code == 2
    assert "--index-url https://download.pytorch.org/whl/cpu" in err and "CUDA machine" in err


def test_a_bug_is_exit_3_with_one_line_and_a_hint_to_report_it(monkeypatch, capsys):
    import hetplan.cli.show as show

    def broken(path):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(show, "load_plan", broken)
    code, _, err = run(["show", "plan.json"], capsys)
    assert code == 3 and err.count("\n") == 1
    assert "internal error: ZeroDivisionError: boom" in err and "report" in err


def test_a_two_gpu_node_plans_a_pipeline_whose_first_stage_is_the_main_part(tmp_path, monkeypatch, capsys):
    populate(tmp_path)
    two = NODE.replace("gpus:\n", "gpus:\n  - {name: second, memory: 2GiB, mem_bandwidth: 100GB/s, "
                                  "flops: {fp32: 10TFLOPS}}\n")
    (tmp_path / "two.yaml").write_text(two)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["compile", "config.json", "--hw", "two.yaml", "-o", "p.json"], capsys)
    assert code == 0, err
    assert "of 2 devices" in err and "pipeline over" in out and "its first stage alone" in out
    code, out, _ = run(["show", "p.json"], capsys)
    assert "are the pipeline's first stage (GPU 0 (second), layers" in out
    assert "pipeline over" in out and "GPU 0 (second)" in out and "llama.cpp --split-mode layer" in out


def test_summary_names_the_dtype_and_batch(tmp_path, monkeypatch, capsys):
    populate(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["compile", "config.json", "--hw", "node.yaml", "-o", "p.json"], capsys)
    assert code == 0 and "[fp32 weights, batch 1, ilp, optimal" in out


def test_check_of_a_directory_checks_every_plan_and_the_worst_code_wins(tmp_path, monkeypatch, capsys):
    populate(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans").mkdir()
    assert run(["compile", "config.json", "--hw", "node.yaml", "-o", "plans/b.json"], capsys)[0] == 0
    (tmp_path / "plans" / "a.json").write_text("{")  # sorts first, unreadable
    code, out, err = run(["check", "plans"], capsys)
    assert code == 2
    assert "ERROR plans/a.json" in out and "OK plans/b.json" in out  # the later plan was still checked
    assert err.count("\n") == 1


def test_check_resolves_a_relative_hw_against_the_plans_directory(tmp_path, monkeypatch, capsys):
    populate(tmp_path)
    monkeypatch.chdir(tmp_path)
    model = str(tmp_path / "config.json")  # a model's default name comes from its path, so keep it fixed
    assert run(["compile", model, "--hw", "node.yaml", "-o", "p.json"], capsys)[0] == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run(["check", "../p.json"], capsys)
    assert code == 0, out + err
    assert "OK ../p.json" in out and "identical" in out


def test_a_cpu_mem_fix_is_offered_only_when_the_node_has_that_much_dram_and_then_it_compiles(
        tmp_path, monkeypatch, capsys):
    """A node whose reserve leaves 1 MiB of its 8 GiB to plans: the fix is --cpu-mem (within the
    8 GiB), and compiling with it succeeds."""
    populate(tmp_path)
    (tmp_path / "small.yaml").write_text(NODE.replace("{gpu: 1KiB, cpu: 1KiB}", "{gpu: 1KiB, cpu: 8191MiB}"))
    monkeypatch.chdir(tmp_path)
    argv = ["compile", "config.json", "--hw", "small.yaml", "--gpu-mem", "16KiB", "-o", "p.json"]
    code, _, err = run(argv, capsys)
    fix = re.search(r"--cpu-mem (\d+GiB)", err)
    assert code == 2 and fix and "a machine with" not in err, err
    assert run(argv + ["--cpu-mem", fix.group(1)], capsys)[0] == 0


def test_the_heartbeat_waits_quiet_s_before_the_first_line_then_heartbeat_s_after_each_line():
    sink = progress._Sink(lambda text: None)
    t0 = sink.t0
    assert sink.due_s(t0) == pytest.approx(progress.QUIET_S)  # a quick command stays silent
    sink("a line")
    assert sink.due_s(sink.last) == pytest.approx(progress.HEARTBEAT_S)
    assert sink.due_s(sink.last + progress.HEARTBEAT_S) <= 0
    assert progress.HEARTBEAT_S <= 1.0  # room for a loaded machine's scheduling below 1.5 s


def test_the_runtime_asks_for_huge_pages_unless_the_user_chose(monkeypatch):
    from hetplan.cli.app import require_torch

    pytest.importorskip("torch")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    require_torch("exec")
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    require_torch("exec")
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_exec_memory_fixes_are_values_the_flags_accept_and_no_more_than_is_free():
    pytest.importorskip("torch")
    from hetplan.runtime.devices import check_free_memory
    from hetplan.units import parse_bytes

    free = int(22.84 * 2**30)
    memory = {"gpu_bytes": 129 << 30, "cpu_bytes": 3 << 30}
    with pytest.raises(HetplanError) as cpu_only:
        check_free_memory(memory, "cpu", free_gpu_bytes=None, free_cpu_bytes=free // 10)
    value = re.search(r"--cpu-mem (\S+)", str(cpu_only.value)).group(1)
    assert parse_bytes(value, "--cpu-mem") <= free // 10
    with pytest.raises(HetplanError) as emulated:  # a plan for a 141 GB GPU, emulated in 22.84 GiB of RAM
        check_free_memory(memory, "emulated", free_gpu_bytes=None, free_cpu_bytes=free)
    assert "add up to at most 22GiB" in str(emulated.value)


def test_hetplan_alone_prints_its_help_on_stdout(capsys):
    code, out, err = run([], capsys)
    assert code == 0 and out.startswith("Usage: hetplan") and "compile" in out and err == ""
