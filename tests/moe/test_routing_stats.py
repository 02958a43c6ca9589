"""stats.json, the routing-statistics file: written deterministically, read back equal, and
refused with a message naming what is wrong when it does not fit the model. No torch here."""

from __future__ import annotations

import json

import pytest

from hetplan.errors import HetplanError
from hetplan.frontends.resolve import load_model
from hetplan.routing import (RoutingStats, load_routing, routing_fingerprint, stats_from_counts,
                             write_routing)


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b")  # 32 MoE layers, 8 experts, 2 per token


@pytest.fixture(scope="module")
def deepseek():
    return load_model("deepseek-v3")  # layers 0-2 dense, 256 experts, 8 per token


def _write(tmp_path, doc) -> str:
    p = tmp_path / "stats.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def _valid(spec) -> dict:
    """Layer 5 skewed (expert 0 in every token's top-2), the rest uniform."""
    skewed = [1.0, 0.5, 0.5] + [0.0] * (spec.n_experts - 3)
    return {"model_fingerprint": routing_fingerprint(spec), "tokens": 10,
            "layers": {"5": skewed, "6": [spec.experts_per_token / spec.n_experts] * spec.n_experts}}


def test_fractions_are_counts_over_tokens_and_round_trip(tmp_path, mixtral):
    counts = {3: [4, 0, 1, 1, 0, 2, 0, 0], 4: [1, 1, 1, 1, 1, 1, 1, 1]}
    stats = stats_from_counts(mixtral, counts, tokens=4)
    assert stats.layers[3] == (1.0, 0.0, 0.25, 0.25, 0.0, 0.5, 0.0, 0.0)
    write_routing(tmp_path / "a.json", stats)
    write_routing(tmp_path / "b.json", load_routing(tmp_path / "a.json", mixtral))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert load_routing(tmp_path / "a.json", mixtral) == stats
    doc = json.loads((tmp_path / "a.json").read_text())
    assert set(doc) == {"model_fingerprint", "tokens", "layers"} and set(doc["layers"]) == {"3", "4"}


def test_statistics_apply_to_the_same_model_in_another_dtype(tmp_path, mixtral):
    path = _write(tmp_path, _valid(mixtral))
    assert load_routing(path, mixtral.with_dtypes("fp32", "fp32")).layers[5][0] == 1.0


def test_ranked_experts_put_the_hottest_first_and_unrecorded_layers_are_uniform(tmp_path, mixtral):
    stats = load_routing(_write(tmp_path, _valid(mixtral)), mixtral)
    assert stats.ranked_experts(5, mixtral)[:3] == (0, 1, 2)
    assert stats.expert_fractions(20, mixtral) == (0.25,) * 8
    assert stats.ranked_experts(20, mixtral) == tuple(range(8))


def test_tokens_is_optional(tmp_path, mixtral):
    doc = _valid(mixtral)
    del doc["tokens"]
    assert load_routing(_write(tmp_path, doc), mixtral).tokens is None


def _bad(spec, **change):
    doc = _valid(spec)
    for key, value in change.items():
        if value is None:
            del doc[key]
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize("mutate,message", [
    (lambda s: _bad(s, model_fingerprint="0123456789abcdef"),
     "recorded for model fingerprint 0123456789abcdef"),
    (lambda s: _bad(s, model_fingerprint=None), "missing key 'model_fingerprint'"),
    (lambda s: _bad(s, layers=None), "missing key 'layers'"),
    (lambda s: dict(_valid(s), extra=1), r"unknown keys \['extra'\]"),
    (lambda s: _bad(s, tokens=0), "'tokens' must be an integer in 1 .. "),
    (lambda s: _bad(s, layers=[0.25] * 8), "layers: expected a mapping"),
    (lambda s: _bad(s, layers={"x": [0.25] * 8}), "key 'x' is not a layer index"),
    (lambda s: _bad(s, layers={"32": [0.25] * 8}), "layers.32: not an MoE layer"),
    (lambda s: _bad(s, layers={"1": [0.25] * 7}), "7 fractions, but the model has 8 experts"),
    (lambda s: _bad(s, layers={"1": [1.5, 0.5] + [0.0] * 6}), r"'layers.1\[0\]' must be a number in \[0, 1\], got 1.5"),
    (lambda s: _bad(s, layers={"1": [-0.5, 1.0, 1.5] + [0.0] * 5}), r"'layers.1\[0\]' must be a number in \[0, 1\], got -0.5"),
    (lambda s: _bad(s, layers={"1": [0.125] * 8}), "sum to 1, expected 2"),
    (lambda s: _bad(s, layers={"1": ["a"] * 8}), r"layers.1\[0\]: input should be a valid number, got 'a'"),
    (lambda s: [1, 2], "expected a JSON object"),
])
def test_bad_statistics_are_refused_with_what_is_wrong(tmp_path, mixtral, mutate, message):
    with pytest.raises(HetplanError, match=message):
        load_routing(_write(tmp_path, mutate(mixtral)), mixtral)


def test_dense_layers_of_deepseek_have_no_statistics(tmp_path, deepseek):
    doc = {"model_fingerprint": routing_fingerprint(deepseek), "layers": {"2": [8 / 256] * 256}}
    with pytest.raises(HetplanError, match=r"layers.2: not an MoE layer .* \(MoE layers: 3..60\)"):
        load_routing(_write(tmp_path, doc), deepseek)
    doc["layers"] = {"3": [8 / 256] * 256}
    assert load_routing(_write(tmp_path, doc), deepseek).layers[3][0] == 8 / 256


def test_malformed_json_names_line_and_column(tmp_path, mixtral):
    with pytest.raises(HetplanError, match=r"stats.json:2:\d+: malformed JSON"):
        load_routing(_write(tmp_path, '{"model_fingerprint": "x",\n "layers": {,}}'), mixtral)


def test_a_missing_file_says_how_to_record_one(tmp_path, mixtral):
    with pytest.raises(HetplanError, match="--record-routing"):
        load_routing(tmp_path / "nope.json", mixtral)


def test_dense_models_have_no_routing_statistics(tmp_path):
    llama = load_model("llama-3.1-8b")
    doc = {"model_fingerprint": routing_fingerprint(llama), "layers": {}}
    with pytest.raises(HetplanError, match="has no experts"):
        load_routing(_write(tmp_path, doc), llama)


def test_no_tokens_no_statistics(mixtral):
    with pytest.raises(HetplanError, match="no tokens were routed"):
        stats_from_counts(mixtral, {}, tokens=0)


def test_stats_are_plain_data():
    stats = RoutingStats("f", {3: (0.5, 1.5)}, 7)
    assert json.loads(stats.to_json()) == {"model_fingerprint": "f", "layers": {"3": [0.5, 1.5]}, "tokens": 7}
