"""node.yaml with several GPUs: per-pair links, NUMA sockets, the multi-GPU presets, and the
mistakes one can make writing them (one line, exit 2)."""

import json

import pytest
import yaml

from hetplan.cli import main
from hetplan.hardware import HardwareSpec, PeerLink, load_node, parse_node
from hetplan.presets.nodes import NODE_PRESETS

GPU = "{name: g, memory: 24GiB, mem_bandwidth: 900GB/s, flops: {fp16: 70TFLOPS}}"
NODE = f"""
gpus: [{GPU}, {GPU}, {GPU}]
cpu: {{name: c, cores: 16, sockets: 2, memory: 128GiB, mem_bandwidth: 50GB/s, flops: {{fp32: 1TFLOPS}}}}
links: {{h2d: 25GB/s}}
peers: [{{between: [0, 1], kind: nvlink, bandwidth: 100GB/s}}]
"""


def test_a_listed_pair_has_its_link_and_an_unlisted_pair_goes_through_the_host():
    hw = parse_node(yaml.safe_load(NODE))
    assert hw.peer(0, 1) == PeerLink(0, 1, "nvlink", 100e9)
    assert hw.peer(1, 0).bytes_per_s == 100e9
    assert hw.peer(1, 2).kind == "host" and hw.peer(1, 2).bytes_per_s is None


def test_between_all_links_every_pair():
    raw = yaml.safe_load(NODE)
    raw["peers"] = [{"between": "all", "kind": "nvswitch", "bandwidth": "450GB/s"}]
    hw = parse_node(raw)
    assert {(p.a, p.b) for p in hw.peers} == {(0, 1), (0, 2), (1, 2)}
    assert all(hw.peer(a, b).bytes_per_s == 450e9 for a in range(3) for b in range(3) if a != b)


def test_numa_sockets_are_read_per_gpu():
    raw = yaml.safe_load(NODE)
    raw["gpus"][2]["numa"] = 1
    hw = parse_node(raw)
    assert [g.numa for g in hw.gpus] == [None, None, 1]


def test_the_multi_gpu_presets_hold_what_their_names_say():
    two = load_node("2x3090-128g")
    one = load_node("rtx3090-128g")
    assert len(two.gpus) == 2 and two.gpus[0].memory_bytes == 24 * 2**30
    for k in range(2):  # the card's constants are the single-3090 preset's
        assert (two.gpus[k].mem_bytes_per_s, two.gpus[k].flops_per_s) == (one.gpu.mem_bytes_per_s,
                                                                          one.gpu.flops_per_s)
    assert two.cpu.memory_bytes == 128 * 2**30
    assert two.peer(0, 1).kind == "pcie" and two.h2d_bytes_per_s == 25e9 / 2  # x8: half of x16
    a100 = load_node("4xa100-80g")
    assert len(a100.gpus) == 4 and {a100.peer(a, b).kind for a in range(4) for b in range(a + 1, 4)} == {"nvlink"}
    h100 = load_node("8xh100")
    assert len(h100.gpus) == 8 and len(h100.peers) == 8 * 7 // 2
    assert {p.kind for p in h100.peers} == {"nvswitch"}


def test_a_single_gpu_node_records_no_multi_gpu_keys():
    d = load_node("rtx3090-128g").to_dict()
    assert "peers" not in d and all("numa" not in g for g in d["gpus"]) and "numa" not in d["cpu"]


@pytest.mark.parametrize("preset", sorted(NODE_PRESETS))
def test_every_preset_survives_the_plan_round_trip(preset):
    hw = load_node(preset)
    assert HardwareSpec.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


@pytest.mark.parametrize("edit, says", [
    ({"peers": [{"between": [0, 3], "kind": "pcie", "bandwidth": "25GB/s"}]}, "names GPU 3"),
    ({"peers": [{"between": [0, 1], "kind": "pcie", "bandwidth": 25}]}, "no unit"),
    ({"peers": [{"between": [0, 1], "kind": "pcie"}]}, "needs a bandwidth"),
    ({"peers": [{"between": [1, 1], "kind": "nvlink", "bandwidth": "50GB/s"}]}, "names one GPU twice"),
    ({"peers": [{"between": [0, 1], "kind": "host", "bandwidth": "50GB/s"}]}, "takes no bandwidth"),
    ({"peers": [{"between": [0, 1], "kind": "infiniband", "bandwidth": "50GB/s"}]}, "kind"),
    ({"gpus[2].numa": 2}, "cpu.sockets is 2"),
])
def test_a_bad_multi_gpu_node_is_one_line_exit_2(edit, says, tmp_path, monkeypatch, capsys):
    raw = yaml.safe_load(NODE)
    for key, value in edit.items():
        if key.startswith("gpus[2]."):
            raw["gpus"][2][key.split(".")[1]] = value
        else:
            raw[key] = value
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "llama-3.1-8b", "--hw", "node.yaml", "-o", "plan.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "node.yaml" in err, err
    assert not (tmp_path / "plan.json").exists()
