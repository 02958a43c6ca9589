"""The synthetic routing profiles: valid statistics, skewed, different per layer, reproducible."""

import json

import numpy as np
import pytest

import hetplan.frontends  # noqa: F401  (presets resolve through the frontends)
from hetplan.errors import HetplanError
from hetplan.presets.models import model_preset
from hetplan.routing import load_routing
from hetplan.routing_gen import main, skewed_profile, zipf_fractions


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
def test_generated_profile_passes_the_routing_loader(model, tmp_path):
    spec = model_preset(model)
    out = tmp_path / "stats.json"
    assert main([model, "-o", str(out), "--skew", "1.2", "--seed", "3"]) == 0
    stats = load_routing(out, spec)
    moe_layers = [l for l in range(spec.n_layers) if spec.is_moe_layer(l)]
    assert sorted(stats.layers) == moe_layers
    for fr in stats.layers.values():
        assert sum(fr) == pytest.approx(spec.experts_per_token, rel=1e-6) and max(fr) <= 1.0
    assert len({stats.ranked_experts(l, spec) for l in moe_layers}) > 1, "every layer ranks alike"


def test_zipf_fractions_follow_the_power_law_and_cap_at_one():
    f = zipf_fractions(8, 2, 1.0)
    h = sum(1 / r for r in range(1, 9))
    assert f == pytest.approx([2 / (r * h) for r in range(1, 9)])   # none reaches 1 here
    capped = zipf_fractions(8, 4, 3.0)                               # the hottest would exceed 1
    assert capped.sum() == pytest.approx(4.0) and (np.diff(capped) <= 1e-12).all()
    full = int((capped == 1.0).sum())
    assert full >= 1 and capped[full] < 1.0
    rest = capped[full:]
    assert rest / rest[0] == pytest.approx([(full + 1) ** 3 / r ** 3 for r in range(full + 1, 9)])
    assert zipf_fractions(8, 2, 0.0) == pytest.approx([0.25] * 8)


def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path):
    spec = model_preset("mixtral-8x7b")
    a, b = skewed_profile(spec, 1.0, 0).to_json(), skewed_profile(spec, 1.0, 0).to_json()
    assert a == b and skewed_profile(spec, 1.0, 1).to_json() != a
    assert json.loads(a)["model_fingerprint"]


def test_a_dense_model_or_a_negative_skew_is_a_clear_error(capsys, tmp_path):
    with pytest.raises(HetplanError, match="no experts"):
        skewed_profile(model_preset("llama-3.1-8b"))
    with pytest.raises(HetplanError, match="--skew"):
        skewed_profile(model_preset("mixtral-8x7b"), skew=-1)
    assert main(["llama-3.1-8b", "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
