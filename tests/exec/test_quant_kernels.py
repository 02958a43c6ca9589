"""Quantised formats and the kernels that multiply with them, against outside references.

- Bytes: the planner's price of a linear (``hetplan.dtypes.packed_bytes``) and of a whole block
  (``ModelSpec.block_weight_bytes``) equal what the runtime allocates, for every format, and
  both equal the sizes written in ``tests.exec.quant_spec`` from the format definitions.
- Values: the runtime's packed bytes, decoded by ``quant_spec`` (numpy, from the definitions),
  are within the format's rounding of the original weights; q8_0 and q4_0 bytes equal the
  ``gguf`` package's quantisers' (GGUF's reference), and their dequantised values equal its
  dequantisers'.
- Kernels: ``linear`` on packed weights equals x @ decode(bytes)^T in float64, for every format,
  shapes that are not multiples of the block size, decode-sized and prefill-sized x, on the
  native kernel's fp32 paths and on the portable torch path; bf16/fp16 through the native upcasting kernel
  equal ``F.linear`` in fp32 on the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetplan import dtypes
from hetplan.runtime.kernels import linear as klinear
from hetplan.runtime.kernels import native, quant
from hetplan.runtime.kernels.linear import PackedLinear, linear
from hetplan.runtime.kernels.packed import packed_layout
from hetplan.runtime.models import dense_layout
from hetplan.frontends.resolve import load_model
from tests.exec import quant_spec
from tests.exec.test_numerics import save_tiny_model

FORMATS = ("int8", "int4", "q8_0", "q4_0", "q4_k_m")
SHAPES = [(7, 33), (40, 100), (33, 300), (64, 512), (5, 17)]


def weights(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g)


def packed(fmt, w) -> PackedLinear:
    return PackedLinear(fmt, w.shape[1], (quant.split(fmt, quant.quantise(fmt, w), tuple(w.shape)),))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_planner_bytes_equal_runtime_allocation(fmt, shape):
    rows, cols = shape
    allocated = quant.quantise(fmt, weights(shape)).numel()
    assert allocated == quant_spec.nbytes(fmt, rows, cols) == quant.nbytes(fmt, shape)
    assert dtypes.packed_bytes(fmt, rows, cols) == -(-allocated // 16) * 16


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_bytes_priced_equal_block_bytes_allocated(tmp_path, fmt):
    save_tiny_model("llama", tmp_path)
    spec = load_model(str(tmp_path), fmt, "fp32")
    for kind, layer in (("attn", 0), ("mlp", 0), ("head", None)):
        layout = packed_layout(fmt, dense_layout.block_tensors(spec, kind, layer), torch.float32)
        assert layout.nbytes == spec.block_weight_bytes(kind, layer), kind


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_packed_values_within_the_format_rounding(fmt, shape):
    w = weights(shape, 1)
    got = quant_spec.decode(fmt, quant.quantise(fmt, w).numpy(), *shape)
    err = np.abs(got - w.double().numpy())
    assert (err <= quant_spec.step(fmt, w.double().numpy())).all()
    # and the runtime's own dequantiser reads the same values (up to fp32 arithmetic)
    mine = quant.dequantise(fmt, quant.quantise(fmt, w), shape, torch.empty(shape)).double().numpy()
    assert np.abs(mine - got).max() <= 1e-6 * np.abs(got).max()


@pytest.mark.parametrize("fmt,qtype", [("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
@pytest.mark.parametrize("shape", [(8, 64), (5, 33), (3, 300)])
def test_q8_0_q4_0_bytes_equal_gguf_reference(fmt, qtype, shape):
    gguf = pytest.importorskip("gguf")
    rows, cols = shape
    w = weights(shape, 2)
    w[0, :5] = 0.0                                         # a block with zeros, and a zero block
    if cols >= 64:
        w[1, 32:64] = 0.0
    nb = -(-cols // 32)
    padded = np.zeros((rows, 32 * nb), dtype=np.float32)
    padded[:, :cols] = w.numpy()
    ref = gguf.quantize(padded, getattr(gguf.GGMLQuantizationType, qtype)).reshape(rows, nb, -1)  # [rows, nb, 2 + q]
    d, q = quant_spec.arrays(fmt, quant.quantise(fmt, w).numpy(), rows, cols)
    assert np.array_equal(d.view(np.uint8).reshape(rows, nb, 2), ref[..., :2])
    assert np.array_equal(q.view(np.uint8).reshape(rows, nb, -1), ref[..., 2:])
    deq = gguf.dequantize(ref.reshape(rows, -1), getattr(gguf.GGMLQuantizationType, qtype))[:, :cols]
    mine = quant.dequantise(fmt, quant.quantise(fmt, w), shape, torch.empty(shape))
    assert np.array_equal(mine.numpy(), deq.astype(np.float32))


def reference(x: torch.Tensor, fmt: str, w: torch.Tensor) -> np.ndarray:
    rows, cols = w.shape
    return x.double().numpy() @ quant_spec.decode(fmt, quant.quantise(fmt, w).numpy(), rows, cols).T


def assert_close(got: torch.Tensor, ref: np.ndarray, x: torch.Tensor, w: torch.Tensor):
    """fp32 accumulation over K terms: within 1e-5 of sum |x||w| per output."""
    bound = 1e-5 * (x.abs().double().numpy() @ w.abs().double().numpy().T) + 1e-6
    assert (np.abs(got.double().numpy() - ref) <= bound).all()


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """The fp32 paths (x multiplied in int8 is ``test_int8_kernels``'s, with its own bound)."""
    monkeypatch.setenv("HETPLAN_INT8_PREFILL", "0")
    monkeypatch.setenv("HETPLAN_INT8_DECODE", "0")
    if request.param == "native":
        if native.module() is None:
            pytest.skip(f"native kernel unavailable: {native.unavailable()}")
    else:
        monkeypatch.setattr(native, "module", lambda: None)
        monkeypatch.setattr(klinear, "TILE_ELEMS", 1000)  # several tiles even for small weights
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_packed_linear_equals_dequantise_then_matmul(path, fmt, shape, m):
    w = weights(shape, 3)
    x = torch.randn(m, shape[1])
    assert_close(linear(x, packed(fmt, w)), reference(x, fmt, w), x, w)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k_m"])
def test_fused_linear_and_bias_and_leading_dims(path, fmt):
    a, b = weights((24, 96), 4), weights((40, 96), 5)
    x = torch.randn(2, 3, 96)
    bias = torch.randn(64)
    got = linear(x, PackedLinear.cat([packed(fmt, a), packed(fmt, b)]), bias)
    ref = np.concatenate([reference(x.view(6, 96), fmt, a), reference(x.view(6, 96), fmt, b)], axis=1) + bias.numpy()
    assert got.shape == (2, 3, 64)
    assert_close(got.view(6, 64), ref, x.view(6, 96), torch.cat([a, b]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(40, 100), (64, 512)])
def test_16bit_upcasting_kernel_equals_fp32_matmul(monkeypatch, dtype, shape):
    """The path of a CPU without native 16-bit arithmetic: weights upcast per block of 32."""
    if native.module() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable()}")
    monkeypatch.setenv("HETPLAN_CPU_16BIT", "0")
    w = weights(shape, 6).to(dtype)
    x = torch.randn(1, shape[1]).to(dtype)
    assert klinear._native_dense(x, w)
    got = linear(x, w).float()
    ref = x.double().numpy() @ w.double().numpy().T
    scale = (x.abs().double().numpy() @ w.abs().double().numpy().T)
    assert (np.abs(got.double().numpy() - ref) <= 1e-2 * scale + 1e-3).all()  # the output rounded to 16 bits
    exact = native.module().matmul(x.float(), klinear.FORMAT_IDS[dtype], shape[1], [w], False)
    assert (np.abs(exact.double().numpy() - ref) <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(40, 100), (75, 33)])
@pytest.mark.parametrize("m", [9, 64])
def test_16bit_prefill_without_16bit_gemms_is_an_fp32_matmul_a_tile_at_a_time(monkeypatch, dtype, shape, m):
    """A CPU without 16-bit GEMMs (forced by ``HETPLAN_CPU_UPCAST``): more rows than the native
    kernel takes are multiplied in fp32 by tiles of upcast weights (here 3 x 100 weights, so
    several tiles and a short last one), each output rounded to x's dtype: within that rounding
    of x @ w^T in float64, and within fp32 accumulation of it before the rounding."""
    monkeypatch.setenv("HETPLAN_CPU_UPCAST", "1")
    monkeypatch.setattr(klinear, "TILE_ELEMS", 300)
    w, bias = weights(shape, 21).to(dtype), torch.randn(shape[0]).to(dtype)
    x = torch.randn(2, m, shape[1]).to(dtype)
    assert not klinear._native_dense(x, w) and klinear._upcast(w)
    xd, wd = x.view(2 * m, -1).double().numpy(), w.double().numpy()
    ref = xd @ wd.T
    scale = np.abs(xd) @ np.abs(wd).T
    unit = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)   # half an ulp of the 16-bit output
    got = linear(x, w).view(2 * m, -1).double().numpy()
    assert (np.abs(got - ref) <= unit * np.abs(ref) + 1e-5 * scale + 1e-6).all()
    exact = klinear.upcast_linear(x.view(2 * m, -1).float(), w).double().numpy()   # fp32 in, fp32 out
    assert (np.abs(exact - ref) <= 1e-5 * scale + 1e-6).all()
    with_bias = linear(x, w, bias).view(2 * m, -1).double().numpy()
    assert (np.abs(with_bias - (ref + bias.double().numpy())) <= 2 * unit * (np.abs(ref) + np.abs(bias.double().numpy()))
            + 1e-5 * scale + 1e-6).all()
    wt = w.t().contiguous()   # a checkpoint's transposed [in, out] tensor (GPT-2's Conv1D)
    got_t = klinear.linear_t(x, wt).view(2 * m, -1).double().numpy()
    assert (np.abs(got_t - ref) <= unit * np.abs(ref) + 1e-5 * scale + 1e-6).all()


def test_16bit_gemms_are_taken_where_the_cpu_has_them(monkeypatch):
    monkeypatch.delenv("HETPLAN_CPU_UPCAST", raising=False)
    monkeypatch.setattr(klinear, "_CPU_16BIT", {})
    monkeypatch.setattr(native, "cpu_flags", lambda: "avx2 avx512f avx512_bf16 fma")
    assert klinear.cpu_gemms_16bit(torch.bfloat16) and not klinear.cpu_gemms_16bit(torch.float16)
    assert not klinear._upcast(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert klinear._upcast(torch.zeros(4, 4, dtype=torch.float16))
    assert not klinear._upcast(torch.zeros(4, 4))   # fp32: torch's GEMM


@pytest.mark.parametrize("shape", [(40, 100), (64, 512), (5, 17)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_fp32_gemv_kernel_equals_fp32_matmul(shape, m):
    """fp32 weights at a decode-sized x take the native GEMV: within fp32 accumulation of x @ w^T."""
    if native.module() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable()}")
    w, x, bias = weights(shape, 14), torch.randn(1, m, shape[1]), torch.randn(shape[0])
    assert klinear._native_dense(x, w) and not klinear._native_dense(torch.randn(9, shape[1]), w)
    got = linear(x, w, bias).view(m, -1)
    xd = x.view(m, -1).double().numpy()
    ref = xd @ w.double().numpy().T + bias.double().numpy()
    assert (np.abs(got.double().numpy() - ref) <= 1e-5 * (np.abs(xd) @ w.abs().double().numpy().T) + 1e-6).all()


@pytest.fixture
def two_threads():
    """Decode kernels hand chunks of rows (about 256 KiB of weight bytes each) to whichever
    thread is free; with two threads and weights of many chunks, every chunk must land once."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
def test_decode_over_many_chunks_of_rows(path, two_threads, fmt, m):
    """Two fused segments of 300 and 333 rows of 4096 (6 to 40 chunks, one across the segments'
    boundary) on the fp32 paths, against x @ decode(bytes)^T."""
    a, b = weights((300, 4096), 15), weights((333, 4096), 16)
    x = torch.randn(m, 4096)
    got = linear(x, PackedLinear.cat([packed(fmt, a), packed(fmt, b)]))
    ref = np.concatenate([reference(x, fmt, a), reference(x, fmt, b)], axis=1)
    assert_close(got, ref, x, torch.cat([a, b]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_decode_over_many_chunks_of_rows(two_threads, dtype):
    """fp32 and 16-bit weights at a decode-sized x (16 rows of 4096 fp32 a chunk): within fp32
    accumulation of x @ w^T on the weights as stored."""
    if native.module() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable()}")
    w, x = weights((1000, 4096), 17).to(dtype), torch.randn(3, 4096).to(dtype)
    if not klinear._native_dense(x, w):
        pytest.skip("this CPU multiplies this dtype with torch's GEMV")
    xd, wd = x.double().numpy(), w.double().numpy()
    got = linear(x, w).double().numpy()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]   # the output's rounding
    ref = xd @ wd.T
    assert (np.abs(got - ref) <= 1e-5 * (np.abs(xd) @ np.abs(wd).T) + ulp * np.abs(ref) + 1e-6).all()
