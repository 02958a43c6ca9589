"""Machine presets, written as node.yaml text from spec sheets (parsed like a user's file).

Peaks are vendor dense figures; bandwidths are practical pinned-copy and STREAM-class numbers.
``hetplan profile`` replaces them with measurements on a machine one has.
"""

NODE_PRESETS: dict[str, str] = {
    # Desktop: RTX 4090 (AD102, 1008 GB/s, 165 TFLOPS fp16 w/ fp32 accumulate) + i9-13900K,
    # 64 GiB DDR5-5600 dual channel (89.6 GB/s), PCIe 4.0 x16.
    "rtx4090-64g": """
name: rtx4090-64g
gpus: [{name: RTX 4090, class: consumer, memory: 24GiB, mem_bandwidth: 1008GB/s,
        flops: {fp16: 165TFLOPS, bf16: 165TFLOPS, fp32: 82.6TFLOPS}}]
cpu: {name: i9-13900K, class: desktop, cores: 24, memory: 64GiB, mem_bandwidth: 89.6GB/s,
      flops: {fp32: 1.2TFLOPS, bf16: 1.2TFLOPS}}
links: {h2d: 25GB/s, d2h: 25GB/s}
reserve: {gpu: 1GiB, cpu: 4GiB}
""",
    # Desktop: RTX 3090 (936 GB/s, 71 TFLOPS fp16 tensor) + Ryzen 9 5950X, 128 GiB DDR4-3200
    # dual channel (51.2 GB/s), PCIe 4.0 x16.
    "rtx3090-128g": """
name: rtx3090-128g
gpus: [{name: RTX 3090, class: consumer, memory: 24GiB, mem_bandwidth: 936GB/s,
        flops: {fp16: 71TFLOPS, bf16: 71TFLOPS, fp32: 35.6TFLOPS}}]
cpu: {name: Ryzen 9 5950X, class: desktop, cores: 16, memory: 128GiB, mem_bandwidth: 51.2GB/s,
      flops: {fp32: 1.0TFLOPS, bf16: 1.0TFLOPS}}
links: {h2d: 25GB/s, d2h: 25GB/s}
reserve: {gpu: 1GiB, cpu: 4GiB}
""",
    # Cloud: NVIDIA T4 16 GB (320 GB/s, 65 TFLOPS fp16) on a 32-vCPU Xeon VM with 208 GB DRAM,
    # PCIe 3.0 x16 (the FlexGen paper's machine).
    "t4-208g": """
name: t4-208g
gpus: [{name: Tesla T4, class: datacenter, memory: 16GB, mem_bandwidth: 320GB/s,
        flops: {fp16: 65TFLOPS, fp32: 8.1TFLOPS}}]
cpu: {name: Xeon 2.0GHz (32 vCPU), class: server, cores: 16, memory: 208GB, mem_bandwidth: 60GB/s,
      flops: {fp32: 1.0TFLOPS, bf16: 0.5TFLOPS}}
links: {h2d: 12GB/s, d2h: 12GB/s}
reserve: {gpu: 1GiB, cpu: 8GiB}
price: {per_hour: 0.35}
""",
    # Cloud: A100 40 GB SXM (1555 GB/s, 312 TFLOPS bf16) + 256 GiB of 8-channel DDR4-3200, PCIe 4.0.
    "a100-40g-256g": """
name: a100-40g-256g
gpus: [{name: A100-SXM4-40GB, class: datacenter, memory: 40GB, mem_bandwidth: 1555GB/s,
        flops: {bf16: 312TFLOPS, fp16: 312TFLOPS, fp32: 19.5TFLOPS}}]
cpu: {name: EPYC 7742 (32 cores), class: server, cores: 32, memory: 256GiB, mem_bandwidth: 150GB/s,
      flops: {fp32: 2.0TFLOPS, bf16: 2.0TFLOPS}}
links: {h2d: 25GB/s, d2h: 25GB/s}
reserve: {gpu: 1GiB, cpu: 8GiB}
price: {per_hour: 1.30}
""",
    # Server slice: H200 141 GB HBM3e (4.8 TB/s, 989 TFLOPS bf16 dense), 16 cores, 128 GiB, PCIe 5.0.
    "h200-128g": """
name: h200-128g
gpus: [{name: H200, class: datacenter, memory: 141GB, mem_bandwidth: 4800GB/s,
        flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}]
cpu: {name: Xeon (16 cores), class: server, cores: 16, memory: 128GiB, mem_bandwidth: 120GB/s,
      flops: {fp32: 1.5TFLOPS, bf16: 3.0TFLOPS}}
links: {h2d: 50GB/s, d2h: 50GB/s}
reserve: {gpu: 2GiB, cpu: 8GiB}
price: {per_hour: 3.50}
""",
    # Laptop: an 8 GB mobile GPU (RTX 4070 Laptop class, 256 GB/s) + 32 GiB DDR5-4800, PCIe 4.0 x8.
    "laptop-8g": """
name: laptop-8g
gpus: [{name: RTX 4070 Laptop, class: consumer, memory: 8GiB, mem_bandwidth: 256GB/s,
        flops: {fp16: 45TFLOPS, bf16: 45TFLOPS, fp32: 15TFLOPS}}]
cpu: {name: Core i7 mobile, class: desktop, cores: 8, memory: 32GiB, mem_bandwidth: 76.8GB/s,
      flops: {fp32: 0.6TFLOPS, bf16: 0.6TFLOPS}}
links: {h2d: 12GB/s, d2h: 12GB/s}
reserve: {gpu: 0.75GiB, cpu: 4GiB}
""",
    # Server: RTX 4090 in an EPYC 9004 box, 12-channel DDR5-4800 (460.8 GB/s), 512 GiB, AVX-512 BF16.
    "epyc-4090-512g": """
name: epyc-4090-512g
gpus: [{name: RTX 4090, class: consumer, memory: 24GiB, mem_bandwidth: 1008GB/s,
        flops: {fp16: 165TFLOPS, bf16: 165TFLOPS, fp32: 82.6TFLOPS}}]
cpu: {name: EPYC 9654 (64 cores), class: server, cores: 64, memory: 512GiB, mem_bandwidth: 460.8GB/s,
      flops: {fp32: 4.0TFLOPS, bf16: 8.0TFLOPS}}
links: {h2d: 25GB/s, d2h: 25GB/s}
reserve: {gpu: 1GiB, cpu: 16GiB}
""",
    # Workstation: two RTX 3090 (the rtx3090-128g card) without NVLink, each on PCIe 4.0 x8
    # (x8/x8 bifurcation: ~12.5 GB/s pinned each way, half of x16), peer-to-peer over the same
    # lanes; Ryzen 9 5950X, 128 GiB DDR4-3200 dual channel.
    "2x3090-128g": """
name: 2x3090-128g
gpus:
  - {name: RTX 3090, class: consumer, memory: 24GiB, mem_bandwidth: 936GB/s, numa: 0,
     flops: {fp16: 71TFLOPS, bf16: 71TFLOPS, fp32: 35.6TFLOPS}}
  - {name: RTX 3090, class: consumer, memory: 24GiB, mem_bandwidth: 936GB/s, numa: 0,
     flops: {fp16: 71TFLOPS, bf16: 71TFLOPS, fp32: 35.6TFLOPS}}
cpu: {name: Ryzen 9 5950X, class: desktop, cores: 16, memory: 128GiB, mem_bandwidth: 51.2GB/s,
      flops: {fp32: 1.0TFLOPS, bf16: 1.0TFLOPS}}
links: {h2d: 12.5GB/s, d2h: 12.5GB/s}
peers: [{between: [0, 1], kind: pcie, bandwidth: 12.5GB/s}]
reserve: {gpu: 1GiB, cpu: 4GiB}
""",
    # Server: four A100 80 GB SXM (2039 GB/s, 312 TFLOPS bf16) fully connected by NVLink 3
    # (300 GB/s per direction), two EPYC 7763 sockets (GPUs 0-1 on socket 0, 2-3 on socket 1),
    # 1 TiB of 16-channel DDR4-3200, PCIe 4.0 x16 to each GPU.
    "4xa100-80g": """
name: 4xa100-80g
gpus:
  - {name: A100-SXM4-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 2039GB/s, numa: 0,
     flops: {bf16: 312TFLOPS, fp16: 312TFLOPS, fp32: 19.5TFLOPS}}
  - {name: A100-SXM4-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 2039GB/s, numa: 0,
     flops: {bf16: 312TFLOPS, fp16: 312TFLOPS, fp32: 19.5TFLOPS}}
  - {name: A100-SXM4-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 2039GB/s, numa: 1,
     flops: {bf16: 312TFLOPS, fp16: 312TFLOPS, fp32: 19.5TFLOPS}}
  - {name: A100-SXM4-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 2039GB/s, numa: 1,
     flops: {bf16: 312TFLOPS, fp16: 312TFLOPS, fp32: 19.5TFLOPS}}
cpu: {name: 2x EPYC 7763, class: server, cores: 128, sockets: 2, memory: 1TiB, mem_bandwidth: 409.6GB/s,
      flops: {fp32: 5.0TFLOPS, bf16: 5.0TFLOPS}}
links: {h2d: 25GB/s, d2h: 25GB/s}
peers: [{between: all, kind: nvlink, bandwidth: 300GB/s}]
reserve: {gpu: 1GiB, cpu: 16GiB}
""",
    # Server: eight H100 80 GB SXM (3350 GB/s, 989 TFLOPS bf16 dense) on NVSwitch (NVLink 4,
    # 450 GB/s per direction between any pair), two Xeon 8480+ sockets (GPUs 0-3 on socket 0),
    # 2 TiB DDR5-4800 (16 channels), PCIe 5.0 x16 to each GPU.
    "8xh100": """
name: 8xh100
gpus:
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 0,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 0,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 0,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 0,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 1,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 1,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 1,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
  - {name: H100-SXM5-80GB, class: datacenter, memory: 80GB, mem_bandwidth: 3350GB/s, numa: 1,
     flops: {bf16: 989TFLOPS, fp16: 989TFLOPS, fp32: 67TFLOPS}}
cpu: {name: 2x Xeon 8480+, class: server, cores: 112, sockets: 2, memory: 2TiB, mem_bandwidth: 614.4GB/s,
      flops: {fp32: 6.0TFLOPS, bf16: 12.0TFLOPS}}
links: {h2d: 50GB/s, d2h: 50GB/s}
peers: [{between: all, kind: nvswitch, bandwidth: 450GB/s}]
reserve: {gpu: 2GiB, cpu: 32GiB}
""",
    # A machine with no GPU: every plan is all-CPU (what `hetplan profile` writes on one).
    "cpu-64g": """
name: cpu-64g
gpus: []
cpu: {name: generic x86-64, class: desktop, cores: 16, memory: 64GiB, mem_bandwidth: 80GB/s,
      flops: {fp32: 1.0TFLOPS, bf16: 1.0TFLOPS}}
reserve: {cpu: 4GiB}
""",
}
