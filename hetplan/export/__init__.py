"""``hetplan export``: a plan written as another engine's configuration, and what that costs.

One module per engine (``llama_cpp``, ``accelerate``, ``vllm``, ``ktransformers``) turns a plan
into the configuration its users write; ``names`` knows what each engine calls a block's
weights, ``regex`` writes compact layer-range patterns, ``result`` holds the shared result type
and prices an export by re-reading it with the engine's reader (``hetplan.solvers.imported``)
and compiling it on the plan's own problem. Pure: no torch, no engine is run or imported.
"""
