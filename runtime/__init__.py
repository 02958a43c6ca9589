"""The torch runtime: executes a plan exactly as written and measures the run.

``session.run_plan`` is the entry point (``hetplan exec`` calls it). It places weights and KV
caches by the plan (``residency``, reading ``weights``), turns each phase's task list into a
program (``dataflow``) and runs it with one queue per resource (``executor``) on a CUDA GPU or
an emulated one (``devices``). The model math lives in backends (the interface in ``backend``,
the families in ``models/``, ONNX graphs in ``onnx/``), quantised formats in ``kernels/``, and
``profiler/`` measures the machine with the same kernels.
"""
