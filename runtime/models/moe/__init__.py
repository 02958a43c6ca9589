"""Mixture-of-experts families (mixtral, qwen3_moe, deepseek_v3) as plan stages.

``layer`` holds router, experts and the layer's forward; ``split`` the four stages of a block
split between HBM and DRAM; ``backend`` the family backend; ``weights`` the checkpoint names of
each family and the assembly of MoE/MLA pieces; ``reference`` a plain forward pass used as an
oracle. Knows nothing about the plan's schedule beyond the stage it is asked to run.
"""
