"""Per-device-class defaults: a node.yaml's GPU and CPU class select the constants it leaves out."""

import pytest
import yaml

from hetplan.errors import HetplanError
from hetplan.hardware import load_node, parse_node
from hetplan.presets.device_classes import CLASS_DEFAULTS

NODE = """
gpus: [{name: g, memory: 24GiB, mem_bandwidth: 1000GB/s, flops: {fp16: 100TFLOPS}}]
cpu: {name: c, cores: 16, memory: 128GiB, mem_bandwidth: 100GB/s, flops: {fp32: 1TFLOPS}}
links: {h2d: 25GB/s}
"""


def node(**edits) -> dict:
    raw = yaml.safe_load(NODE)
    for path, value in edits.items():
        d = raw
        *parts, last = path.split("__")
        for part in parts:
            d = d["gpus"][0] if part == "gpus" else d.setdefault(part, {})
        d[last] = value
    return raw


def test_a_node_without_classes_is_a_consumer_gpu_on_a_desktop_cpu():
    hw = parse_node(node())
    assert (hw.gpus[0].device_class, hw.cpu.device_class) == ("consumer", "desktop")
    for key in ("gpu_mem", "gpu_flops"):
        assert hw.efficiency[key] == CLASS_DEFAULTS["consumer"][key]
    for key in ("cpu_mem", "cpu_flops"):
        assert hw.efficiency[key] == CLASS_DEFAULTS["desktop"][key]
    assert hw.efficiency["link"] == CLASS_DEFAULTS["link"]["link"]
    assert hw.latency_s == {"gpu_task": CLASS_DEFAULTS["consumer"]["gpu_task"],
                            "cpu_task": CLASS_DEFAULTS["desktop"]["cpu_task"],
                            "link_task": CLASS_DEFAULTS["link"]["link_task"]}


def test_each_class_takes_its_own_constants_and_only_for_its_own_device():
    hw = parse_node(node(gpus__class="datacenter", cpu__class="server"))
    assert hw.efficiency["gpu_mem"] == CLASS_DEFAULTS["datacenter"]["gpu_mem"]
    assert hw.latency_s["gpu_task"] == CLASS_DEFAULTS["datacenter"]["gpu_task"]
    assert hw.efficiency["cpu_mem"] == CLASS_DEFAULTS["server"]["cpu_mem"]
    assert hw.latency_s["cpu_task"] == CLASS_DEFAULTS["server"]["cpu_task"]


def test_a_key_given_in_the_node_wins_over_its_class():
    hw = parse_node(node(gpus__class="datacenter", efficiency__gpu_mem=0.5, latency__link_task=1e-4))
    assert hw.efficiency["gpu_mem"] == 0.5
    assert hw.latency_s["link_task"] == 1e-4
    assert hw.efficiency["gpu_flops"] == CLASS_DEFAULTS["datacenter"]["gpu_flops"]


def test_the_classes_differ_where_the_published_runs_say_they_do():
    # the fitted table is not one set copied four times: at least one constant differs per pair
    for a, b in (("consumer", "datacenter"), ("desktop", "server")):
        assert CLASS_DEFAULTS[a] != CLASS_DEFAULTS[b]


@pytest.mark.parametrize("where,value", [("gpus__class", "gaming"), ("cpu__class", "workstation"),
                                         ("gpus__class", 1)])
def test_an_unknown_class_names_the_accepted_ones(where, value):
    with pytest.raises(HetplanError) as e:
        parse_node(node(**{where: value}))
    msg = str(e.value)
    assert "class" in msg and ("consumer" in msg or "desktop" in msg)


def test_the_presets_name_their_classes():
    expect = {"rtx4090-64g": ("consumer", "desktop"), "rtx3090-128g": ("consumer", "desktop"),
              "laptop-8g": ("consumer", "desktop"), "t4-208g": ("datacenter", "server"),
              "a100-40g-256g": ("datacenter", "server"), "h200-128g": ("datacenter", "server"),
              "epyc-4090-512g": ("consumer", "server"), "cpu-64g": (None, "desktop")}
    for name, (gpu, cpu) in expect.items():
        hw = load_node(name)
        assert (hw.gpus[0].device_class if hw.gpus else None, hw.cpu.device_class) == (gpu, cpu), name


def test_the_readme_lists_the_defaults_as_the_code_holds_them():
    from pathlib import Path
    from hetplan.presets.device_classes import class_table
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    begin, end = "<!-- device-classes:begin -->\n", "<!-- device-classes:end -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == class_table()
