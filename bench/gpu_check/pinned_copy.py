"""A plain pinned host-to-device copy of 1 GiB, median of 6: the bandwidth streamed loads are held against."""

import json
import sys

import torch

src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
dst = torch.empty_like(src, device="cuda")
rates = []
for _ in range(6):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dst.copy_(src, non_blocking=True)
    b.record()
    b.synchronize()
    rates.append(src.numel() / (a.elapsed_time(b) / 1e3))
json.dump({"pinned_h2d_bytes_per_s": sorted(rates)[len(rates) // 2]}, open(sys.argv[1], "w"))
