"""A GGUF file with ``rope_freqs.weight`` (Llama 3.1's scaling as llama.cpp's converter keeps it)
plans and runs with the file's frequency factors.

The oracle is transformers' ``llama3`` rope: the file's factors are written by llama.cpp's
converter formula (``tests.gguf.files.llama3_rope_factors``) from one set of llama3 parameters,
and transformers, reading the same file (its GGUF loader ignores ``rope_freqs.weight``), is given
those parameters. A short original context makes most frequencies scaled within a 16-token run,
and the test checks that ignoring the factors would be far outside its tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.frontends.gguf.families import spec_from_gguf
from hetplan.runtime.session import RunOptions, run_plan
from tests.gguf.files import Dims, llama3_rope_factors, write_header_only, write_model
from tests.gguf.test_logits import EXACT, GEN_LEN, PROMPT_LEN, REL_TOL, greedy_reference, reference_model

DIMS = Dims()
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FACTORS = llama3_rope_factors(10000.0, DIMS.head_dim, 8.0, 1.0, 4.0, 64)


@pytest.fixture(scope="module")
def scaled_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rope") / "m.gguf"
    write_model(path, "llama", EXACT, seed=21, rope_freqs=FACTORS)
    model = reference_model(path, "llama")
    unscaled = greedy_reference(model, IDS)
    model.config.rope_parameters = dict(LLAMA3)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
    return path, greedy_reference(model, IDS), unscaled


IDS = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(9))


def test_the_factors_scale_most_frequencies():
    assert sum(f > 1 for f in FACTORS) > len(FACTORS) // 2 and 1.0 in FACTORS
    assert any(1 < f < 8 for f in FACTORS)                               # the smooth band is exercised


@pytest.mark.parametrize("strategy", ["all-gpu", "ngl:1"])
def test_exec_rotates_by_the_files_factors(scaled_file, node, strategy):
    path, ref, unscaled = scaled_file
    full, steps, tokens, unscaled_full = ref["prefill"], ref["steps"], ref["tokens"], unscaled["prefill"]
    req = CompileRequest(model=str(path), hw=node, strategy=strategy, prompt_len=PROMPT_LEN, gen_len=GEN_LEN,
                         kv_dtype="fp32")
    plan = compile_plan(req)[0]
    assert plan.model.rope_scaling["rope_type"] == "gguf_rope_freqs"
    result = run_plan(plan, RunOptions(weights=str(path), prompt_ids=(tuple(IDS[0].tolist()),), gen_len=GEN_LEN,
                                       all_logits=True, keep_logits=True, emulate=True))
    scale = full.abs().max().item()
    assert (full - unscaled_full).abs().max().item() > 100 * REL_TOL * scale   # the factors matter
    assert (result.logits[0] - full).abs().max().item() <= REL_TOL * scale
    got = torch.stack([result.logits[0][:, -1]] + result.logits[1:])
    assert (got - steps).abs().max().item() <= REL_TOL * scale
    assert result.tokens == tokens


def test_llama31_header_gives_transformers_llama3_frequencies(tmp_path):
    """Llama 3.1 8B's own rope scaling, through the file's factors, rotates as transformers'
    llama3 rope of the Hugging Face config."""
    from hetplan.runtime.models.dense import inv_freq
    dims = Dims(layers=1, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=512, context=131072)
    path = tmp_path / "llama31.gguf"
    write_header_only(path, dims, {})
    spec = spec_from_gguf(path)
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=131072)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = LlamaRotaryEmbedding(config=config).inv_freq
    torch.testing.assert_close(inv_freq(spec), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("values, kind, needle", [
    (FACTORS, T.F16, "is F16 [32]; expected F32 [32]"),
    (FACTORS[:16], T.F32, "is F32 [16]; expected F32 [32]"),
    ([0.0] + FACTORS[1:], T.F32, "holds 0.0 at index 0"),
    (FACTORS[:5] + [float("nan")] + FACTORS[6:], T.F32, "holds nan at index 5"),
])
def test_bad_rope_freqs_is_one_line_exit_2(tmp_path, capsys, values, kind, needle):
    path = tmp_path / "bad.gguf"
    write_model(path, "llama", rope_freqs=values, rope_freqs_type=kind)
    with pytest.raises(HetplanError, match="rope_freqs.weight"):
        spec_from_gguf(path)
    assert main(["compile", str(path), "--hw", "cpu-64g", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_exec_with_other_factors_is_refused(tmp_path, node):
    compiled, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(compiled, "llama", rope_freqs=FACTORS)
    write_model(other, "llama", rope_freqs=list(np.array(FACTORS) * 1.5))
    plan = compile_plan(CompileRequest(model=str(compiled), hw=node, strategy="all-gpu", prompt_len=4, gen_len=2))[0]
    with pytest.raises(HetplanError, match="rope_freqs.weight differs from the frequency factors"):
        run_plan(plan, RunOptions(weights=str(other), prompt_ids=((1, 2, 3, 4),), gen_len=2, emulate=True))
    write_model(other, "llama")
    with pytest.raises(HetplanError, match="not the file the plan was compiled from"):
        run_plan(plan, RunOptions(weights=str(other), prompt_ids=((1, 2, 3, 4),), gen_len=2, emulate=True))
