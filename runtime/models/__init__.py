"""The model math, one plan stage at a time: what each task computes, for each family.

``dense`` (llama, mistral, qwen2, qwen3, opt, gpt2) with its checkpoint layouts in
``dense_layout``; ``mla`` (DeepSeek's latent attention); ``moe`` (the mixture-of-experts families,
whole or split between HBM and DRAM). Each backend implements ``hetplan.runtime.backend``'s
interface. Knows nothing about queues, streams, tiers or when a tensor may be freed: the
executor decides that.
"""
