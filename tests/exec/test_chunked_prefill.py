"""Chunked prefill: the runtime computes what transformers computes whatever the chunk size,
and its prefill allocates what the planner prices.

Logits at every prompt position and over 31 decode steps match transformers (fp32, 1e-4) for
chunk sizes that divide the prompt and sizes that do not, with attention on the emulated GPU and
with the KV cache in DRAM; the activation bytes the prefill's stages allocate, tracked op by op
while the stage chain runs, stay within the planner's workspace at every chunk size.
"""

from __future__ import annotations

import pytest
import torch

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.graph import workspace_bytes
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.workload import Workload
from tests.conftest import tiny_spec
from tests.exec.stage_memory import prefill_peak_bytes
from tests.exec.test_numerics import GEN_LEN, TOL, cpu_kv_plan, reference, save_tiny_model
from tests.tiny_models import TINY_GPU_NODE

PROMPT = 24
CHUNKS = (5, 8, 24)
"""5 and 7 leave a shorter last chunk, 8 divides the prompt, 24 is the whole prompt."""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "gpu.yaml"
    path.write_text(TINY_GPU_NODE)
    return str(path)


@pytest.fixture(scope="module", params=("llama", "opt", "qwen3"))
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    m = save_tiny_model(request.param, directory)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    return str(directory), ids, reference(m, ids)


def check_matches(result, ref):
    prefill = result.logits[0]
    assert prefill.shape == ref["prefill"].shape
    assert (prefill - ref["prefill"]).abs().max().item() <= TOL
    steps = torch.stack([result.logits[0][:, -1]] + result.logits[1:])
    assert (steps - ref["steps"]).abs().max().item() <= TOL
    assert result.tokens == ref["tokens"]


@pytest.mark.parametrize("chunk", (5, 7, 8))
def test_chunked_prefill_matches_transformers(model, node, chunk):
    model_dir, ids, ref = model
    req = CompileRequest(model=model_dir, hw=node, strategy="all-gpu", weight_dtype="fp32", prompt_len=PROMPT,
                         gen_len=GEN_LEN, prefill_chunk=chunk)
    plan = compile_plan(req)[0]
    assert plan.workload.prefill_chunk == chunk and plan.workload.n_chunks == -(-PROMPT // chunk)
    result = run_plan(plan, RunOptions(weights=model_dir, prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN,
                                       all_logits=True, keep_logits=True, emulate=True))
    check_matches(result, ref)


@pytest.mark.parametrize("chunk", (5, 8))
def test_chunked_prefill_with_kv_in_dram_matches_transformers(model, node, chunk):
    """Attention on the GPU, every KV cache in DRAM: each chunk's K/V is copied down."""
    model_dir, ids, ref = model
    plan = cpu_kv_plan(model_dir, node, prompt_len=PROMPT, prefill_chunk=chunk)
    assert plan.workload.n_chunks == -(-PROMPT // chunk)
    result = run_plan(plan, RunOptions(weights=model_dir, prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN,
                                       all_logits=True, keep_logits=True, emulate=True))
    check_matches(result, ref)


@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("batch,prompt,chunk", [(1, 256, 256), (1, 256, 64), (2, 256, 32), (2, 512, 512),
                                                (1, 1024, 100), (2, 1024, 256)])
def test_planned_workspace_covers_what_the_prefill_allocates(dtype, batch, prompt, chunk):
    """The planner's workspace is at least the peak of live activation bytes measured op by op
    (``stage_memory``) and at most 10% above it (the mask of a small last chunk is priced at
    full length before the projections' temporaries are freed)."""
    spec = tiny_spec(weight_dtype=dtype, kv_dtype=dtype)
    measured = prefill_peak_bytes(spec, batch, prompt, chunk)
    planned = workspace_bytes(spec, Workload(batch, prompt, 1, prefill_chunk=chunk), "gpu")
    assert measured <= planned <= 1.10 * measured


@pytest.mark.parametrize("batch,prompt,chunk", [(1, 256, 256), (2, 256, 32), (1, 1024, 100), (2, 1024, 256)])
def test_the_cpu_workspace_covers_a_16bit_prefill_upcast_a_tile_at_a_time(batch, prompt, chunk):
    """On a CPU without 16-bit GEMMs a bf16 prefill also holds fp32 copies (x, a tile of weights,
    its products): the CPU's workspace covers them, within what rounding the tile to whole rows
    and the peaks' coinciding leave (at most 1.5x)."""
    spec = tiny_spec(weight_dtype="bf16", kv_dtype="bf16", vocab=9000)
    measured = prefill_peak_bytes(spec, batch, prompt, chunk, upcast=True)
    planned = workspace_bytes(spec, Workload(batch, prompt, 1, prefill_chunk=chunk), "cpu")
    assert measured > prefill_peak_bytes(spec, batch, prompt, chunk)
    assert measured <= planned <= 1.5 * measured


def test_smaller_chunks_allocate_less():
    spec = tiny_spec(weight_dtype="fp32", kv_dtype="fp32")
    peaks = [prefill_peak_bytes(spec, 1, 1024, c) for c in (1024, 256, 64)]
    assert peaks[0] > peaks[1] > peaks[2]
