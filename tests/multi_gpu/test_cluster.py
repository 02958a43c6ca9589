"""cluster.yaml: nodes joined by a network, the hop across it priced by hand, plans whose stages
span the nodes (against every split priced by the same planner), and the mistakes one can make
writing one (one line, exit 2, nothing written)."""

import dataclasses
import json

import pytest

from hetplan.pipeline.cluster import load_hardware
from hetplan.compiler import CompileRequest, stage_solver
from hetplan.pipeline import plan_pipeline
from hetplan.pipeline.plan import fixed_pipeline
from hetplan.pipeline.topology import Network, Topology
from hetplan.workload import Workload
from tests.conftest import tiny_node, tiny_spec
from tests.errors.workdir import CONFIG, NODE, populate, run

WL = Workload(batch=1, prompt_len=64, gen_len=16, objective="latency", prefill_chunk=64)
SOLVE = stage_solver(CompileRequest(model="tiny", hw="tiny"))
CLUSTER = "name: pair\nnodes: [node.yaml, node.yaml]\nnetwork: {bandwidth: 8Gbit/s, latency: 100us}\n"


def test_the_desktop_cluster_preset_is_four_4090_desktops_on_10gbe():
    topo = load_hardware("4xdesktop-10gbe")
    assert [n.name for n in topo.nodes] == ["rtx4090-64g"] * 4
    assert topo.devices == ((0, 0), (1, 0), (2, 0), (3, 0))
    assert topo.network.bytes_per_s == pytest.approx(9.4e9 / 8) and topo.network.latency_s == pytest.approx(50e-6)


def test_a_hop_between_nodes_is_out_of_the_gpu_across_the_network_and_into_the_next():
    topo = Topology("t", (tiny_node(1), tiny_node(1), tiny_node(None)), Network(1e9, 100e-6))
    nbytes = 1e6
    copy = nbytes / (16e9 * 0.9) + 10e-6  # the tiny node's d2h and h2d: bytes / (16 GB/s x 0.9) + 10 us
    wire = nbytes / 1e9 + 100e-6
    assert topo.hop((0, 0), (1, 0), nbytes) == ("network", pytest.approx(copy + wire + copy))
    assert topo.hop((1, 0), (2, None), nbytes) == ("network", pytest.approx(copy + wire))  # a CPU node: no h2d
    assert topo.hop((2, None), (0, 0), nbytes) == ("network", pytest.approx(wire + copy))


def every_split(spec, topo, wl):
    """Brute force over one or two stages on any devices in order, priced by the same planner."""
    L, n = spec.n_layers, len(topo.devices)
    splits = [((k, 0, L),) for k in range(n)]
    splits += [((j, 0, s), (k, s, L)) for j in range(n) for k in range(j + 1, n) for s in range(1, L)]
    costs = {}
    for split in splits:
        pp = fixed_pipeline(spec, topo, wl, split, SOLVE)
        if pp is not None:
            costs[split] = pp.predicted()["latency_s"]
    return costs


@pytest.mark.parametrize("gpu_mib, net", [(3, 1e9), (3, 1e7), (100, 1e9)])
def test_the_cluster_pipeline_is_the_cheapest_split_over_its_nodes(gpu_mib, net):
    spec = tiny_spec(n_layers=3)
    topo = Topology("t", (tiny_node(gpu_mib / 1024, cpu_gib=0.01), tiny_node(gpu_mib / 1024, cpu_gib=0.01)),
                    Network(net, 50e-6))
    costs = every_split(spec, topo, WL)
    pp = plan_pipeline(spec, topo, WL, SOLVE)
    assert pp.predicted()["latency_s"] == pytest.approx(min(costs.values()), rel=1e-9)
    if len(pp.stages) == 2:
        assert pp.links[0]["kind"] == "network" and [s.node for s in pp.stages] == [0, 1]


def test_a_node_without_a_gpu_contributes_its_cpu_as_a_stage_device():
    topo = Topology("t", (tiny_node(3 / 1024, cpu_gib=0.01), tiny_node(None, cpu_gib=1)), Network(1e9, 50e-6))
    assert topo.devices == ((0, 0), (1, None))
    d = plan_pipeline(tiny_spec(n_layers=4), topo, WL, SOLVE).to_dict()
    for s in d["stages"]:
        assert ("gpu" in s) == (s["node"] == 0)


def write_cluster(tmp_path, text):
    populate(tmp_path)
    (tmp_path / "cluster.yaml").write_text(text)


def test_a_model_only_two_nodes_hold_compiles_over_them_and_show_and_check_read_it(tmp_path, monkeypatch, capsys):
    # two fp32 layers of ~9.4 MB each: one node (14 MiB of GPU, 3 MiB of DRAM) holds one, not both
    small = NODE.replace("memory: 2GiB", "memory: 14MiB").replace("memory: 8GiB", "memory: 3MiB")
    write_cluster(tmp_path, CLUSTER)
    (tmp_path / "node.yaml").write_text(small)
    (tmp_path / "wide.json").write_text(json.dumps(dict(CONFIG, hidden_size=512, intermediate_size=1024,
                                                        vocab_size=256)))
    monkeypatch.chdir(tmp_path)
    args = ["compile", "wide.json", "--weight-dtype", "fp32", "--prompt-len", "32", "--gen-len", "8", "-o", "p.json"]
    code, _, err = run(args + ["--hw", "node.yaml"], capsys)
    assert code == 2 and "no placement fits" in err
    code, out, err = run(args + ["--hw", "cluster.yaml"], capsys)
    assert code == 0, err
    assert "no single device holds the model" in err
    pp = json.loads((tmp_path / "p.json").read_text())["pipeline"]
    assert [s["node"] for s in pp["stages"]] == [0, 1] and pp["links"][0]["kind"] == "network"
    assert pp["network"] == {"name": "pair", "bytes_per_s": 1e9, "latency_s": 1e-4}
    assert pp["baselines"]["llama.cpp --split-mode layer"] == {  # 3 slots by free memory: 0, 1 on node 0
        "fits": False, "tensor_split": [0.5, 1.0], "stages": [[0, 0, 2]]}
    code, out, _ = run(["show", "p.json"], capsys)
    assert code == 0 and "node 1 GPU 0" in out and "link 0.0->1.0 (network)" in out
    code, out, _ = run(["check", "p.json"], capsys)
    assert code == 0 and out.startswith("OK")


@pytest.mark.parametrize("text, says", [
    ("nodes: [node.yaml, node.yaml]\nnetwork: {bandwidth: 10, latency: 50us}\n", "no unit"),
    ("nodes: [node.yaml, node.yaml]\nnetwork: {bandwidth: 10Gbit/s, latency: 50}\n", "no unit"),
    ("nodes: [node.yaml, nosuch]\nnetwork: {bandwidth: 10Gbit/s, latency: 50us}\n", "nodes[1]: 'nosuch'"),
    ("nodes: [node.yaml, node.yaml]\n", "needs 'network'"),
    ("nodes: [node.yaml]\nnetwrok: {bandwidth: 10Gbit/s, latency: 50us}\n", "netwrok"),
    ("nodes: [node.yaml, node.yaml]\nnetwork: {bandwidth: 1000Tbit/s, latency: 50us}\n", "no network link"),
    ("nodes: []\n", "nodes"),
])
def test_a_bad_cluster_is_one_line_exit_2_and_nothing_written(text, says, tmp_path, monkeypatch, capsys):
    write_cluster(tmp_path, text)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["compile", "config.json", "--hw", "cluster.yaml", "-o", "p.json"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err and "cluster.yaml" in err, err
    assert not (tmp_path / "p.json").exists()


def test_a_broken_node_of_a_cluster_is_named_with_its_index(tmp_path, monkeypatch, capsys):
    write_cluster(tmp_path, "nodes: [node.yaml, bad.yaml]\nnetwork: {bandwidth: 10Gbit/s, latency: 50us}\n")
    (tmp_path / "bad.yaml").write_text(NODE.replace("10GB/s", "10"))
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["compile", "config.json", "--hw", "cluster.yaml", "-o", "p.json"], capsys)
    assert code == 2 and "nodes[1]" in err and "no unit" in err and len(err.strip().splitlines()) == 1, err
