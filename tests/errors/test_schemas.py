"""Every file hetplan writes passes its own schema, and a file that breaks one is refused on one
line naming the file, the line (counted here from the text, independently) and the key."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import yaml

from hetplan.errors import HetplanError
from hetplan.frontends.hf_config import spec_from_config
from hetplan.plan import load_plan
from hetplan.plan.format import content_digest
from hetplan.routing import routing_fingerprint, stats_from_counts
from hetplan.schema.plan import PlanFile
from hetplan.schema.routing import Routing
from tests.errors.workdir import CONFIG, MOE_CONFIG, NODE, populate, run

GOLDENS = sorted(glob.glob(str(Path(__file__).resolve().parents[2] / "plans" / "*.json")))


@pytest.mark.parametrize("path", GOLDENS, ids=[Path(p).name for p in GOLDENS])
def test_every_golden_plan_passes_the_plan_schema(path):
    PlanFile.model_validate(json.loads(Path(path).read_text()))


PRICED_CPU_ONLY = "name: cpu-box\ncpu: {memory: 8GiB, mem_bandwidth: 20GB/s, flops: {fp32: 1TFLOPS}}\n" \
                  "reserve: {cpu: 1KiB}\nprice: {per_hour: 0.5}\n"


@pytest.mark.parametrize("args", [
    ["config.json", "--hw", "node.yaml"],
    ["config.json", "--hw", "node.yaml", "--strategy", "ngl:1"],
    ["config.json", "--hw", "node.yaml", "--objective", "throughput", "--batch", "4"],
    ["config.json", "--hw", "cpu.yaml"],
    ["moe.json", "--hw", "node.yaml"],
    ["moe.json", "--hw", "node.yaml", "--routing", "stats.json", "--stream-cold-experts"],
], ids=["dense-ilp", "baseline", "throughput", "cpu-only-priced", "moe", "moe-routing"])
def test_every_kind_of_compiled_plan_passes_the_plan_schema(args, tmp_path, monkeypatch, capsys):
    populate(tmp_path)
    (tmp_path / "cpu.yaml").write_text(PRICED_CPU_ONLY)
    spec = spec_from_config(MOE_CONFIG)
    stats = stats_from_counts(spec, {0: [3, 1, 2, 2], 1: [4, 0, 2, 2]}, tokens=4)
    (tmp_path / "stats.json").write_text(stats.to_json())
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["compile", *args, "-o", "out.json"], capsys)
    assert code == 0, err
    PlanFile.model_validate(json.loads((tmp_path / "out.json").read_text()))
    load_plan(tmp_path / "out.json")


def test_recorded_routing_statistics_pass_the_routing_schema():
    spec = spec_from_config(MOE_CONFIG)
    stats = stats_from_counts(spec, {0: [1, 1, 1, 1], 1: [2, 0, 1, 1]}, tokens=2)
    doc = json.loads(stats.to_json())
    Routing.model_validate(doc)
    assert doc["model_fingerprint"] == routing_fingerprint(spec)


def line_of(text: str, needle: str, nth: int = 1) -> int:
    """The 1-based line of the ``nth`` line of ``text`` containing ``needle``."""
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    return hits[nth - 1]


@pytest.fixture
def plan_doc(good_plan) -> dict:
    return json.loads(good_plan)


def rewrite(doc: dict, edit) -> str:
    d = json.loads(json.dumps(doc))
    edit(d)
    d["digest"] = content_digest(d)
    return json.dumps(d, sort_keys=True, indent=1)


def test_a_bad_value_deep_in_a_plan_names_its_line_and_key(plan_doc, tmp_path):
    text = rewrite(plan_doc, lambda d: d["placement"][2].update(weights="disk"))
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(HetplanError) as e:
        load_plan(tmp_path / "p.json")
    line = line_of(text, '"weights": "disk"')
    assert str(e.value).startswith(f"{tmp_path / 'p.json'}:{line}: placement[2].weights: ")
    assert "'gpu', 'cpu' or 'stream'" in str(e.value) and "got 'disk'" in str(e.value)


def test_an_unknown_key_deep_in_a_plan_lists_the_accepted_keys(plan_doc, tmp_path):
    text = rewrite(plan_doc, lambda d: d["schedule"]["decode"]["tasks"][1].update(colour="red"))
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(HetplanError) as e:
        load_plan(tmp_path / "p.json")
    msg = str(e.value)
    line = line_of(text, '"colour"')
    assert f":{line}: unknown keys ['colour'] in 'schedule.decode.tasks[1]'" in msg
    assert "accepted: ['block', 'bytes', 'cost_source', 'duration_s'" in msg


def test_an_edge_to_a_missing_task_is_refused(plan_doc, tmp_path):
    text = rewrite(plan_doc, lambda d: d["schedule"]["prefill"]["edges"].append(["embed/embed", "nowhere"]))
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(HetplanError, match=r"schedule\.prefill: edge \('embed/embed', 'nowhere'\) names a task"):
        load_plan(tmp_path / "p.json")


@pytest.mark.parametrize("key,value,says,at", [
    ("num_hiden_layers", 2, "did you mean 'num_hidden_layers'", None),
    ("tie_word_embeddings", "false", "tie_word_embeddings: input should be a valid boolean", None),
    ("rope_theta", "1e4", "rope_theta: input should be a valid number", None),
    ("rope_scaling", {"rope_type": "linear", "factr": 2.0}, "unknown keys ['factr'] in 'rope_scaling'", "factr"),
    ("hidden_size", 2**40, "'hidden_size' must be an integer in 1 .. 16777216", None),
    ("rms_norm_eps", float("inf"), "rms_norm_eps", None),
])
def test_a_config_key_hetplan_reads_is_checked_with_its_line(key, value, says, at, tmp_path):
    from hetplan.frontends.resolve import load_model
    cfg = dict(CONFIG, **{key: value})
    text = json.dumps(cfg, indent=2)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(HetplanError) as e:
        load_model(str(tmp_path / "config.json"))
    assert says in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}:{line_of(text, json.dumps(at or key))}: ")


def test_keys_of_a_real_config_that_hetplan_does_not_read_are_ignored():
    transformers = pytest.importorskip("transformers")
    for family in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "opt", "gpt2"):
        cfg = transformers.CONFIG_MAPPING[family]().to_dict()
        cfg.update(num_hidden_layers=2) if "num_hidden_layers" in cfg else None
        spec_from_config(cfg, source=f"{family} config")


def test_a_node_yaml_error_still_names_its_yaml_line(tmp_path):
    text = NODE.replace("cores: 2", "cores: -3")
    (tmp_path / "node.yaml").write_text(text)
    from hetplan.hardware import load_node
    with pytest.raises(HetplanError) as e:
        load_node(str(tmp_path / "node.yaml"))
    assert f"node.yaml:{line_of(text, 'cores: -3')}:" in str(e.value)
    assert yaml.safe_load(text)["cpu"]["cores"] == -3
