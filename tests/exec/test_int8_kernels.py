"""Packed weights multiplied with x in int8 by the native kernel: with AVX-512 VNNI prefill (more
than 8 rows of x, ``qint8.h``) and decode (up to 8 rows, ``qdecode.h``), with AVX2 both in
``qdecode_avx2.h`` (decode streaming each weight row once, prefill a panel of rows at a time).

The oracle is x @ decode(bytes)^T in float64, the weights decoded by ``tests.exec.quant_spec``
from the format definitions. Quantising x per block of 32 as q8_0 does (dx = max|x_b| / 127,
qx = round(x / dx)) moves x by at most dx / 2 per value, so each output may move by
sum over blocks b of (max|x_b| / 254) * sum_{k in b} |w_k| (derived here, not taken from the
kernel), plus fp32 accumulation (1e-5 of sum |x||w|). Where x is already exact in that grid
(integers in a block whose largest magnitude is 127, times a power of two) nothing may move but
fp32 accumulation. The prefill path is on by default (``HETPLAN_INT8_PREFILL``); with ``0`` (as
on a CPU without VNNI) the fp32 tile path runs and meets the fp32 bound alone. The decode path
is on by default (``HETPLAN_INT8_DECODE``); with ``0`` the fp32 kernel runs
(``test_quant_kernels``, exact against the dequantised weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetplan.runtime.kernels import linear as klinear
from hetplan.runtime.kernels import native, quant
from hetplan.runtime.kernels.linear import PackedLinear, linear
from tests.exec import quant_spec
from tests.exec.test_quant_kernels import FORMATS, packed, two_threads, weights  # noqa: F401 - fixture

SHAPES = [(7, 33), (40, 100), (33, 300), (64, 512), (5, 17), (19, 520), (21, 1000)]


@pytest.fixture
def int8(monkeypatch):
    mod = native.module()
    if mod is None or not mod.has_int8():
        pytest.skip("no int8 kernel here (needs the native kernel built with AVX-512 VNNI or AVX2)")
    monkeypatch.setenv("HETPLAN_INT8_PREFILL", "1")
    monkeypatch.setenv("HETPLAN_INT8_DECODE", "1")
    assert klinear.int8_prefill() and klinear.int8_decode()


def decoded(fmt: str, w: torch.Tensor) -> np.ndarray:
    return quant_spec.decode(fmt, quant.quantise(fmt, w).numpy(), *w.shape)


def fp32_bound(x: np.ndarray, wd: np.ndarray) -> np.ndarray:
    return 1e-5 * (np.abs(x) @ np.abs(wd).T) + 1e-6


def rounding_bound(x: np.ndarray, wd: np.ndarray) -> np.ndarray:
    """sum_b (max|x_b| / 254) * sum_{k in b} |w_k|, [M, N]."""
    k = x.shape[1]
    nb = -(-k // 32)
    xb = np.pad(np.abs(x), ((0, 0), (0, 32 * nb - k))).reshape(len(x), nb, 32).max(-1) / 254
    wb = np.pad(np.abs(wd), ((0, 0), (0, 32 * nb - k))).reshape(len(wd), nb, 32).sum(-1)
    return xb @ wb.T


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 12, 40])
def test_int8_within_the_activation_rounding_bound(int8, fmt, shape, m):
    """m <= 8: the decode kernel; m > 8: the prefill kernel."""
    w = weights(shape, 7)
    x = torch.randn(m, shape[1]) * torch.rand(1, shape[1]) * 3           # blocks of different scales
    xd, wd = x.double().numpy(), decoded(fmt, w)
    err = np.abs(linear(x, packed(fmt, w)).double().numpy() - xd @ wd.T)
    assert (err <= rounding_bound(xd, wd) + fp32_bound(xd, wd)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(40, 100), (19, 520), (5, 17)])
@pytest.mark.parametrize("m", [3, 10, 11, 13])
def test_int8_is_exact_where_x_is_on_its_grid(int8, fmt, shape, m):
    """x = 2^e * integers, each block's largest magnitude 127: dx = 2^e, qx = the integers."""
    k = shape[1]
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (m, k), generator=g).double()
    q[:, ::32] = 127.0                                                   # every block reaches 127
    x = (q * 2.0 ** torch.randint(-6, 3, (m, 1), generator=g)).float()
    w = weights(shape, 9)
    xd, wd = x.double().numpy(), decoded(fmt, w)
    err = np.abs(linear(x, packed(fmt, w)).double().numpy() - xd @ wd.T)
    assert (err <= fp32_bound(xd, wd)).all()


@pytest.mark.parametrize("m", [1, 16])
def test_int8_is_the_path_that_runs(int8, m):
    """Its result differs from the fp32 paths' by activation rounding: the int8 kernel ran."""
    w, x = weights((64, 512), 10), torch.randn(m, 512)
    got = linear(x, packed("q8_0", w)).double().numpy()
    ref = x.double().numpy() @ decoded("q8_0", w).T
    assert np.abs(got - ref).max() > 10 * fp32_bound(x.double().numpy(), decoded("q8_0", w)).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_int8_prefill_the_fp32_tiles_run(monkeypatch, fmt):
    if native.module() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable()}")
    monkeypatch.setenv("HETPLAN_INT8_PREFILL", "0")
    assert not klinear.int8_prefill()
    w, x = weights((40, 100), 11), torch.randn(12, 100)
    xd, wd = x.double().numpy(), decoded(fmt, w)
    err = np.abs(linear(x, packed(fmt, w)).double().numpy() - xd @ wd.T)
    assert (err <= fp32_bound(xd, wd)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 7])
def test_int8_of_fused_linears(int8, fmt, m):
    """A fused linear (three segments, as qkv is) in one call: x quantised once, each segment's
    outputs in its own columns."""
    a, b, c = weights((24, 96), 12), weights((40, 96), 13), weights((17, 96), 14)
    x = torch.randn(2, m, 96)
    got = linear(x, PackedLinear.cat([packed(fmt, a), packed(fmt, b), packed(fmt, c)])).view(2 * m, 81)
    got = got.double().numpy()
    xd, wd = x.view(2 * m, 96).double().numpy(), np.concatenate([decoded(fmt, a), decoded(fmt, b), decoded(fmt, c)])
    assert (np.abs(got - xd @ wd.T) <= rounding_bound(xd, wd) + fp32_bound(xd, wd)).all()


def run_tiny_llama(tmp_path, fmt: str, prompt_len: int, gen_len: int) -> tuple:
    """A tiny llama's plan (``fmt`` weights, on the emulated GPU) run on tokens 3, 4, ... ->
    (the prompt, the run's result, transformers on the weights the packed bytes hold)."""
    from hetplan.compiler import CompileRequest, compile_plan
    from hetplan.runtime.session import RunOptions, run_plan
    from tests.exec.test_numerics import GPU_NODE, save_tiny_model
    from tests.exec.test_quant import dequantised_model
    model = save_tiny_model("llama", tmp_path / "llama")
    (tmp_path / "gpu.yaml").write_text(GPU_NODE)
    prompt = (tuple(range(3, 3 + prompt_len)),)
    plan = compile_plan(CompileRequest(model=str(tmp_path / "llama"), hw=str(tmp_path / "gpu.yaml"),
                                       strategy="all-gpu", weight_dtype=fmt, kv_dtype="fp32",
                                       prompt_len=prompt_len, gen_len=gen_len))[0]
    result = run_plan(plan, RunOptions(weights=str(tmp_path / "llama"), prompt_ids=prompt, gen_len=gen_len,
                                       keep_logits=True, emulate=True))
    return prompt, result, dequantised_model(model, plan.model, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_prefill_logits_within_activation_rounding_of_transformers(int8, tmp_path, fmt):
    """A 16-token prompt (prefill M = 16: the int8 path) against transformers on the weights the
    packed bytes hold. Rounding x per block as q8_0 rounds weights moves the logits by about as
    much as q8_0 weights do: within ``test_quant``'s q8_0 bound of the logits' norm."""
    from tests.exec.test_quant import QUANTISATION_ERROR
    prompt, result, ref = run_tiny_llama(tmp_path, fmt, 16, 1)
    with torch.no_grad():
        want = ref(torch.tensor(prompt)).logits[:, -1]
    got = result.logits[0]
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < QUANTISATION_ERROR["q8_0"]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k_m"])
def test_decode_logits_within_activation_rounding_of_transformers(int8, tmp_path, fmt):
    """8 steps (prompt M = 8 and 7 decode steps at M = 1: the int8 decode kernel) against
    transformers on the weights the packed bytes hold, teacher-forced on hetplan's tokens.
    Rounding x per block as q8_0 rounds weights moves each linear's output by the same relative
    per-block rounding as q8_0 weights do, which ``test_quant``'s q8_0 bound covers for one
    step; a decode step also attends over the keys and values of earlier positions, each
    computed from rounded activations, so the bound is doubled (measured 1.7-4.5 % here)."""
    from tests.exec.test_quant import QUANTISATION_ERROR
    prompt, result, ref = run_tiny_llama(tmp_path, fmt, 8, 8)
    ids = torch.tensor([prompt[0] + tuple(result.tokens[0][:-1])])   # teacher-forced on hetplan's tokens
    with torch.no_grad():
        steps = ref(ids).logits[0, 7:]                                # [8, V]: the logits of each step
    got = torch.stack(result.logits)[:, 0]
    rel = (got - steps).norm(dim=-1) / steps.norm(dim=-1)
    assert (rel > 0).all() and (rel < 2 * QUANTISATION_ERROR["q8_0"]).all(), rel.tolist()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 6])
def test_int8_decode_over_many_chunks_of_rows(int8, two_threads, fmt, m):
    """Two threads taking chunks of rows (about 256 KiB of weight bytes each) as they come free:
    a fused weight of 300 + 333 rows of 4096 (6 to 13 chunks, one across the segments' boundary)."""
    a, b = weights((300, 4096), 18), weights((333, 4096), 19)
    x = torch.randn(m, 4096)
    got = linear(x, PackedLinear.cat([packed(fmt, a), packed(fmt, b)])).double().numpy()
    xd, wd = x.double().numpy(), np.concatenate([decoded(fmt, a), decoded(fmt, b)])
    assert (np.abs(got - xd @ wd.T) <= rounding_bound(xd, wd) + fp32_bound(xd, wd)).all()
