"""hetplan's test suite: behaviour specified against independent oracles (transformers,
onnxruntime, hand-derived formulas, the simulator), on tiny models built in code."""
