"""Property-based fuzzing of every input file: random structures, types and values end as a
parsed object or a HetplanError, never another exception. Seeded (``derandomize``), so CI runs
the same examples every time."""

from __future__ import annotations

import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetplan.errors import HetplanError
from hetplan.frontends.hf_config import spec_from_config
from hetplan.hardware import parse_node
from hetplan.plan import Plan
from hetplan.routing import stats_from_dict
from tests.errors.workdir import CONFIG, MOE_CONFIG, NODE

FUZZ = settings(max_examples=300, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["24GiB", "25GB/s", "165TFLOPS", "0B", "-1GiB", "1e400GB/s", "fp32"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def mutate(doc, data):
    """A copy of ``doc`` with one random path replaced by a random value, deleted, or extended."""
    doc = json.loads(json.dumps(doc))
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append((node, key))
        node = node[key]
    if not path:
        return data.draw(VALUES) if data.draw(st.booleans()) else doc
    parent, key = path[-1]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        parent[key] = data.draw(VALUES)
    elif action == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=8))] = data.draw(VALUES)
    else:
        parent.append(data.draw(VALUES))
    return doc


def accepts_or_refuses(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except HetplanError:
        return None


@FUZZ
@given(st.data())
def test_random_node_yaml_is_a_node_or_a_hetplan_error(data):
    doc = mutate(yaml.safe_load(NODE), data)
    text = yaml.safe_dump(doc)
    accepts_or_refuses(parse_node, yaml.safe_load(text), "fuzz.yaml", text)


@FUZZ
@given(st.data())
def test_random_config_json_is_a_spec_or_a_hetplan_error(data):
    base = data.draw(st.sampled_from([CONFIG, MOE_CONFIG]))
    accepts_or_refuses(spec_from_config, mutate(base, data), source="fuzz.json")


@FUZZ
@given(st.data())
def test_random_routing_statistics_are_stats_or_a_hetplan_error(data):
    spec = spec_from_config(MOE_CONFIG)
    from hetplan.routing import routing_fingerprint
    good = {"model_fingerprint": routing_fingerprint(spec), "tokens": 64,
            "layers": {"0": [0.5, 0.5, 0.5, 0.5], "1": [1.0, 0.25, 0.5, 0.25]}}
    text = json.dumps(mutate(good, data), indent=1)
    accepts_or_refuses(stats_from_dict, json.loads(text), spec, source="fuzz.json", text=text)


_PLAN = {}


def good_plan() -> dict:
    if not _PLAN:
        from hetplan.compiler import _compile_one, CompileRequest
        from hetplan.hardware import parse_node
        spec = spec_from_config(CONFIG)
        hw = parse_node(yaml.safe_load(NODE))
        from hetplan.workload import Workload
        req = CompileRequest(model="config.json", hw="node.yaml", prompt_len=16, gen_len=4)
        plan, _ = _compile_one(spec, hw, Workload(1, 16, 4), req, "ilp", None)
        _PLAN.update(json.loads(plan.to_json()))
    return _PLAN


@FUZZ
@given(st.data())
def test_random_plan_json_is_a_plan_or_a_hetplan_error(data):
    doc = mutate(good_plan(), data)
    text = json.dumps(doc, indent=1)  # through the text, so error lines are looked up too
    plan = accepts_or_refuses(Plan.from_json, text, "fuzz.json", verify=False)
    if plan is not None:  # what `hetplan show` does with a plan it accepted
        from hetplan.plan.report import render_show
        from hetplan.plan.timeline import plan_trace_events, render_svg
        accepts_or_refuses(render_show, plan)
        accepts_or_refuses(render_svg, plan)
        accepts_or_refuses(plan_trace_events, plan)


GOOD_PROFILE = {
    "schema_version": 1,
    "machine": {"cpu_model": "Fuzz CPU", "cpu_count": 2, "memory_bytes": 8 << 30, "gpus": [], "threads": 2},
    "info": {"threads": 2, "torch": "2.13.0", "budget_s": 5.0, "elapsed_s": 4.2, "skipped": [],
             "peaks": {"cpu.mem_bandwidth": 2e10, "cpu.flops.fp32": 1e11, "latency.cpu_task": 2e-6},
             "task_overhead_s": {"cpu": 1e-6, "gpu": 0.0}, "load_average_before": 0.5, "models": ["tiny"]},
    "entries": [{"device": "cpu", "op": "mlp", "dtype": "fp32", "shape": "d64_f128_silu_gated",
                 "points": [{"x": 1.0, "seconds": 1e-4, "spread_s": 1e-6, "repeats": 5, "flops": 1e4,
                             "bytes": 1e5, "source": "measured"},
                            {"x": 8.0, "seconds": 2e-4, "spread_s": 1e-6, "repeats": 5, "flops": 8e4,
                             "bytes": 1.1e5, "source": "measured"}]}],
    "transfers": {},
}


def read_profile(text: str):
    from hetplan.profile.checks import profile_problems
    from hetplan.profile.table import ProfileTable
    table = ProfileTable.from_dict(json.loads(text), "fuzz.profile.json", text=text)
    profile_problems(table)
    return table


def test_the_good_profile_is_accepted():
    read_profile(json.dumps(GOOD_PROFILE))


@FUZZ
@given(st.data())
def test_random_node_profile_json_is_a_table_or_a_hetplan_error(data):
    text = json.dumps(mutate(GOOD_PROFILE, data), indent=1)
    accepts_or_refuses(read_profile, text)


@FUZZ
@given(st.data())
def test_random_config_json_text_is_a_spec_or_a_hetplan_error(data):
    """Through the text as ``load_model`` reads it, so line lookups run on every error."""
    base = data.draw(st.sampled_from([CONFIG, MOE_CONFIG]))
    text = json.dumps(mutate(base, data), indent=1)
    accepts_or_refuses(spec_from_config, json.loads(text), source="fuzz.json", text=text)
