"""The packed-weight kernels on this CPU, side by side in one run: decode GEMV bandwidth against
the DRAM stream, prefill GFLOP/s of the int8 path against the fp32 tile path and torch's GEMM.

    python bench/quant_kernels.py [--threads 2] [--reps 5] [--decode-mib 512] [--compute-only]

Per format (q8_0, q4_0, int8, int4, q4_k_m), with the weight [N, K] = [5632, 2048] (the MLP of
``exec_cpu``'s 0.85 B Llama), random values:

- decode (M = 1): the native kernel's GEMV over a weight of ``--decode-mib`` packed MiB (the
  rows repeated, so the bytes stream from DRAM, not from the caches), GB/s = packed bytes /
  time, x multiplied in int8 (the default where AVX-512 VNNI or AVX2 is) and in fp32; beside it the
  DRAM streaming read (``exec_cpu.bandwidth``: a 1 GiB sum), torch's fp32 GEMV and the native
  fp32 and bf16 GEMVs over the same number of bytes.
- the decode kernels' compute rate (``--compute-only`` prints only this): one thread, a weight
  of 4 MiB of fp32 values (in the caches), GB/s of packed bytes per second of the thread's CPU
  time (``time.thread_time``), M = 1 and 4: what one core can multiply when DRAM is not the
  limit, which a loaded machine changes far less than wall-clock rates.
- prefill (M = 64, 512): GFLOP/s (2 M N K / time) of the int8 path (x quantised per block,
  AVX-512 VNNI or AVX2), of the fp32 tile path (``HETPLAN_INT8_PREFILL=0``: 1 MiB tiles dequantised,
  torch's GEMM per tile) and of torch's fp32 GEMM on the dequantised weight; and in the same
  row torch's own nearest op: for q8_0 ``torch._int_mm`` (int8 x int8 -> int32 with no scales
  at all: the ceiling of a per-tensor int8 GEMM, not a q8_0 kernel), for int8
  ``torch._weight_int8pack_mm`` (bf16 x, int8 weights with per-row scales), for q4_0
  ``torch._weight_int4pack_mm_for_cpu`` (bf16 x, 4-bit groups of 32 with scale and zero).

Every figure is the best of ``--reps`` after one warm-up call. Prints one table; the machine's
load average is printed with it (figures measured under load are not speed results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from exec_cpu import bandwidth  # noqa: E402  (the DRAM stream, measured one way for every bench)

from hetplan.runtime.kernels import native, quant  # noqa: E402
from hetplan.runtime.kernels.linear import FORMAT_IDS  # noqa: E402

N, K = 5632, 2048
THREADS_DEFAULT = 2
FORMATS = ("q8_0", "q4_0", "int8", "int4", "q4_k_m")


def best_s(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def repeated(parts: tuple, nbytes: int, target: int) -> list:
    """The row arrays repeated along the rows until they hold at least ``target`` bytes."""
    times = max(1, -(-target // nbytes))
    return [p.repeat(times, 1) for p in parts]


def decode_gb_s(mod, fmt: str, parts: tuple, target: int, reps: int, int8: bool = True) -> float:
    big = repeated(parts, quant.nbytes(fmt, (N, K)), target)
    x = torch.randn(1, K)
    s = best_s(lambda: mod.matmul(x, FORMAT_IDS[fmt], K, big, int8), reps)
    return sum(p.numel() * p.element_size() for p in big) / s / 1e9


def cpu_s(f, reps: int) -> float:
    """Mean CPU time of this thread per call of ``f`` (after one warm-up call)."""
    f()
    t = time.thread_time()
    for _ in range(reps):
        f()
    return (time.thread_time() - t) / reps


def compute_rates(mod, reps: int) -> None:
    """One thread, weights in the caches: packed GB per CPU second, fp32 and int8 x."""
    torch.set_num_threads(1)
    n, k = 512, 2048
    w = torch.randn(n, k) * torch.rand(n, 1)
    print(f"decode compute rate: 1 thread, W [{n}, {k}] in the caches, GB/s of packed bytes per CPU second")
    print("| weights | M | fp32 x | int8 x | int8 / fp32 |")
    print("|---|---:|---:|---:|---:|")
    for m in (1, 4):
        x = torch.randn(m, k)
        t_torch = cpu_s(lambda: x @ w.t(), reps)
        t_native = cpu_s(lambda: mod.matmul(x, FORMAT_IDS[torch.float32], k, [w], False), reps)
        print(f"| fp32 (torch / native) | {m} | {w.numel() * 4 / t_torch / 1e9:.1f} / {w.numel() * 4 / t_native / 1e9:.1f} "
              f"| - | - |")
        wb = w.bfloat16()
        print(f"| bf16 (native) | {m} | {wb.numel() * 2 / cpu_s(lambda: mod.matmul(x, 5, k, [wb], False), reps) / 1e9:.1f} "
              f"| - | - |")
        for fmt in FORMATS:
            parts = list(quant.split(fmt, quant.quantise(fmt, w), (n, k)))
            nbytes = sum(p.numel() * p.element_size() for p in parts)
            f32 = nbytes / cpu_s(lambda: mod.matmul(x, FORMAT_IDS[fmt], k, parts, False), reps) / 1e9
            i8 = nbytes / cpu_s(lambda: mod.matmul(x, FORMAT_IDS[fmt], k, parts, True), reps) / 1e9 \
                if mod.has_int8() else None
            print(f"| {fmt} | {m} | {f32:.1f} | {'-' if i8 is None else f'{i8:.1f}'} | "
                  f"{'-' if i8 is None else f'{i8 / f32:.2f}x'} |", flush=True)
    torch.set_num_threads(THREADS_DEFAULT)


def prefill_gflop_s(mod, fmt: str, parts: tuple, m: int, reps: int) -> dict:
    x = torch.randn(m, K)
    flop = 2 * m * N * K
    dense = quant.dequantise_rows(fmt, parts, K)
    out = {"int8": flop / best_s(lambda: mod.matmul(x, FORMAT_IDS[fmt], K, list(parts), True), reps),
           "tiles": flop / best_s(lambda: mod.matmul(x, FORMAT_IDS[fmt], K, list(parts), False), reps),
           "fp32 GEMM": flop / best_s(lambda: x @ dense.t(), reps)}
    return {k: v / 1e9 for k, v in out.items()}


TORCH_COUNTERPART = {"q8_0": "torch._int_mm", "int8": "_weight_int8pack_mm", "q4_0": "_weight_int4pack_mm"}
"""torch's own op nearest each format, timed in the same row."""


def torch_counterpart(fmt: str, m: int, reps: int) -> float | None:
    """GFLOP/s of ``TORCH_COUNTERPART[fmt]`` at [m, K] x [N, K]^T (None: torch has none)."""
    if fmt not in TORCH_COUNTERPART:
        return None
    flop = 2 * m * N * K
    g = torch.Generator().manual_seed(0)
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    xb = torch.randn(m, K, generator=g).bfloat16()
    if fmt == "q8_0":
        x8 = torch.randint(-127, 128, (max(m, 17), K), dtype=torch.int8, generator=g)  # _int_mm needs M > 16
        return flop / best_s(lambda: torch._int_mm(x8, w8.t()), reps) / 1e9
    if fmt == "int8":
        scales = torch.rand(N, generator=g).bfloat16()
        return flop / best_s(lambda: torch._weight_int8pack_mm(xb, w8, scales), reps) / 1e9
    w4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g), 1)
    sz = torch.rand(K // 32, N, 2, generator=g).bfloat16()
    return flop / best_s(lambda: torch._weight_int4pack_mm_for_cpu(xb, w4, 32, sz), reps) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-mib", type=int, default=512)
    ap.add_argument("--compute-only", action="store_true", help="only the one-thread decode compute rates")
    args = ap.parse_args(argv)
    mod = native.module()
    if mod is None:
        print(f"quant_kernels: {native.unavailable()}; build the native kernel first", file=sys.stderr)
        return 2
    print(f"load average {os.getloadavg()[0]:.2f}")
    compute_rates(mod, max(50, 20 * args.reps))
    if args.compute_only:
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        return 0
    torch.set_num_threads(args.threads)
    target = args.decode_mib * 2**20
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, W [{N}, {K}], "
          f"int8 prefill kernel: {'yes' if mod.has_int8() else 'no (neither AVX-512 VNNI nor AVX2)'}")
    dram = bandwidth() / 1e9
    w32 = torch.randn(max(1, target // (4 * K)), K)
    x1 = torch.randn(1, K)
    fp32_gemv = w32.numel() * 4 / best_s(lambda: x1 @ w32.t(), args.reps) / 1e9
    native_fp32 = w32.numel() * 4 / best_s(lambda: mod.matmul(x1, FORMAT_IDS[torch.float32], K, [w32], False),
                                           args.reps) / 1e9
    w16 = w32.bfloat16()
    del w32
    native_bf16 = w16.numel() * 2 / best_s(lambda: mod.matmul(x1, FORMAT_IDS[torch.bfloat16], K, [w16], False),
                                           args.reps) / 1e9
    del w16
    print(f"DRAM stream read {dram:.1f} GB/s; fp32 GEMV: torch {fp32_gemv:.1f} GB/s ({fp32_gemv / dram:.2f}x), "
          f"native {native_fp32:.1f} GB/s ({native_fp32 / dram:.2f}x); bf16 GEMV native {native_bf16:.1f} GB/s "
          f"({native_bf16 / dram:.2f}x)")
    print("| format | decode GB/s (int8 x) | of DRAM | decode GB/s (fp32 x) | M | int8 GFLOP/s | fp32 tiles | fp32 GEMM "
          "| int8 / tiles | int8 / GEMM | torch's op (GFLOP/s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    w = torch.randn(N, K) * torch.rand(N, 1)
    for fmt in FORMATS:
        parts = quant.split(fmt, quant.quantise(fmt, w), (N, K))
        gb_s = decode_gb_s(mod, fmt, parts, target, args.reps)
        gb_s32 = decode_gb_s(mod, fmt, parts, target, args.reps, int8=False)
        for m in (64, 512):
            r = prefill_gflop_s(mod, fmt, parts, m, args.reps)
            theirs = torch_counterpart(fmt, m, args.reps)
            op = "-" if theirs is None else f"{TORCH_COUNTERPART[fmt]} {theirs:.1f}"
            print(f"| {fmt} | {gb_s:.1f} | {gb_s / dram:.2f} | {gb_s32:.1f} | {m} | {r['int8']:.1f} | {r['tiles']:.1f} | "
                  f"{r['fp32 GEMM']:.1f} | {r['int8'] / r['tiles']:.2f}x | {r['int8'] / r['fp32 GEMM']:.2f}x | {op} |",
                  flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
