"""``hetplan serve`` over a plan with replicas: one process per replica, each serving the plan of
one replica (a single-process engine, or a pipeline's engine and stage processes) on its own
GPUs at an internal address (``launch``), and a front dealing the requests among them, each to
the replica with the fewest in flight (``front``). Under torchrun (replicas on nodes of their
own, or on one node), one process per stage of every replica in one process group, rank 0
running the front (``torchrun``), a pulse between rank 0 and every process telling each when
the whole must stop (``lifeline``). Knows nothing about tensors.
"""
