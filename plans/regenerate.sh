#!/usr/bin/env bash
# Recompile every golden plan from scratch. The scenario list lives here; `hetplan check plans/`
# recompiles each plan from the inputs it records and fails CI on a regression, and
# `hetplan check --update plans/` accepts today's results.
set -euo pipefail
cd "$(dirname "$0")"

scenario() {  # scenario MODEL NODE [compile options...]
    local model=$1 node=$2
    shift 2
    hetplan compile "$model" --hw "$node" -o "$model--$node.json" "$@"
}

scenario llama-3.1-8b   laptop-8g                       # dense 8B on an 8 GB laptop GPU
scenario llama-3.1-70b  rtx4090-64g                     # 70B on a 24 GB card: auto picks a smaller dtype
scenario qwen2.5-72b    rtx3090-128g                    # 72B bf16 mostly in DDR4
scenario opt-30b        t4-208g --objective throughput --batch 8   # FlexGen's setting
scenario llama-2-7b     a100-40g-256g                   # fits whole: the plan must be all-GPU
scenario mixtral-8x7b   rtx4090-64g                     # MoE, experts spill to DRAM
scenario qwen3-30b-a3b  laptop-8g                       # small-expert MoE on a laptop
scenario deepseek-v3    epyc-4090-512g --weight-dtype q4_k_m   # 671B MoE + MLA on a workstation
scenario opt-175b       h200-128g                       # 175B dense on one H200
scenario llama-3.1-70b  2x3090-128g --weight-dtype q4_k_m      # two cards as pipeline stages
