"""Plans are byte-for-byte deterministic, round-trip losslessly, and refuse to load when they are
newer than this hetplan, truncated, or edited."""

import json

import pytest

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.plan import Plan, load_plan, write_atomic

REQUESTS = {
    "gpu-ilp": CompileRequest(model="llama-2-7b", hw="t4-208g"),
    "gpu-offload-ilp": CompileRequest(model="llama-3.2-1b", hw="laptop-8g", weight_dtype="bf16", gpu_mem="2GiB"),
    "cpu-only": CompileRequest(model="llama-3.1-8b", hw="cpu-64g", prompt_len=128, gen_len=16),
    "stream": CompileRequest(model="opt-6.7b", hw="t4-208g", strategy="stream"),
}
_TEXT = {}


def plan_text(name: str) -> str:
    if name not in _TEXT:
        _TEXT[name] = compile_plan(REQUESTS[name])[0].to_json()
    return _TEXT[name]


@pytest.mark.parametrize("name", list(REQUESTS))
def test_compiling_twice_gives_identical_bytes(name):
    again = compile_plan(REQUESTS[name])[0].to_json()
    assert again == plan_text(name)


def test_cli_writes_identical_files(tmp_path, capsys):
    args = ["compile", "llama-2-7b", "--hw", "t4-208g", "--prompt-len", "256"]
    assert main(args + ["-o", str(tmp_path / "a.json")]) == 0
    assert main(args + ["-o", str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


@pytest.mark.parametrize("name", list(REQUESTS))
def test_plan_file_is_strict_json(name):
    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    json.loads(plan_text(name), parse_constant=refuse)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_load_then_save_round_trips_byte_for_byte(name, tmp_path):
    text = plan_text(name)
    path = tmp_path / "plan.json"
    write_atomic(path, text)
    loaded = load_plan(path)
    assert loaded.to_json() == text
    write_atomic(path, loaded.to_json())
    assert load_plan(path).to_json() == text


def test_newer_schema_version_is_refused():
    d = json.loads(plan_text("gpu-ilp"))
    d["schema_version"] = 2
    with pytest.raises(HetplanError, match=r"p\.json: schema_version 2 is newer than this hetplan "
                                           r"understands \(1\); upgrade hetplan or recompile"):
        Plan.from_json(json.dumps(d), source="p.json")


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    text = plan_text("gpu-ilp")
    path.write_text(text[: len(text) // 2])
    with pytest.raises(HetplanError, match=r"plan\.json:\d+:\d+: malformed JSON.* may be truncated"):
        load_plan(path)


def test_plan_missing_a_section_is_refused():
    d = json.loads(plan_text("gpu-ilp"))
    del d["schedule"]
    with pytest.raises(HetplanError, match=r"p\.json: the plan was edited after it was compiled"):
        Plan.from_json(json.dumps(d), source="p.json")
    with pytest.raises(HetplanError, match=r"p\.json: missing key 'schedule'; recompile"):
        Plan.from_json(json.dumps(d), source="p.json", verify=False)


def test_edited_model_is_refused():
    d = json.loads(plan_text("gpu-ilp"))
    d["model"]["n_layers"] = 16   # fingerprint no longer matches
    with pytest.raises(HetplanError, match=r"p\.json: the plan was edited .*fingerprint mismatch.* recompile"):
        Plan.from_json(json.dumps(d), source="p.json")
    with pytest.raises(HetplanError, match=r"p\.json: model\.fingerprint does not match .* recompile"):
        Plan.from_json(json.dumps(d), source="p.json", verify=False)


def test_edited_placement_is_refused():
    d = json.loads(plan_text("gpu-ilp"))
    d["placement"][1]["weights"] = "cpu"
    with pytest.raises(HetplanError, match=r"edited after it was compiled"):
        Plan.from_json(json.dumps(d), source="p.json")


def test_missing_plan_file_is_refused(tmp_path):
    with pytest.raises(HetplanError, match=r"no such plan file"):
        load_plan(tmp_path / "nope.json")
