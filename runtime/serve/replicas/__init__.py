"""``hetplan serve`` over a plan with replicas: one process per replica, each serving the plan of
one replica (a single-process engine, or a pipeline's engine and stage processes) on its own
GPUs at an internal address (``launch``), and a front dealing the requests among them, each to
the replica with the fewest in flight (``front``). Knows nothing about tensors.
"""
