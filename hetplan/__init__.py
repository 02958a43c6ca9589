"""hetplan: a compiler for CPU-GPU heterogeneous LLM inference.

The pure core lives here (specs, cost model, plan format, simulator, CLI) and never imports
torch. Solvers live in ``hetplan.solvers`` and the torch runtime in ``hetplan.runtime``.
"""

__version__ = "0.1.0"
