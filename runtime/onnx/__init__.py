"""ONNX models as plan stages: each block runs its own nodes of the graph with torch.

``ops`` implements the operators of ``hetplan.frontends.onnx.opset``, ``run`` interprets nodes,
``weights`` serves initializers and the constants computed from them, ``backend`` is the plan
backend. Knows nothing about queues or tiers beyond the backend interface.
"""
