"""Running a GGUF file: its tensors read memory-mapped and held as the plan priced them.

``source.GgufWeights`` is a weight source (like ``hetplan.runtime.weights.Checkpoint``) over a
.gguf file: it finds the file tensor behind each Hugging Face name a backend asks for, hands a
linear over packed in its runtime format (``hetplan.frontends.gguf.held``'s rule) and anything
else dequantised; ``repack`` turns each ggml type's blocks into the runtime's formats. Knows
nothing about plans beyond the model spec, nor about tiers or schedules.
"""
