"""The runtime: plan execution, numerics against transformers, weights, KV caches, scheduling."""
