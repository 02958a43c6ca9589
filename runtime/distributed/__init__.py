"""Run a pipeline plan (plan.json's ``pipeline``) as one process per stage on torch.distributed.

Each process runs one stage: the single-GPU plan recorded for it (``hetplan.pipeline.record``),
cut down to the blocks it holds (``part``: its layers, the embedding on the first stage only,
the head on the last only), placed and executed by the ordinary runtime (``Residency``,
``Executor``; ``stage``). Between stages the hidden state goes forward with point-to-point
``isend``/``irecv``, and the last stage's sampled token goes back to the first for the next
decode step (``worker``, ``peers``): NCCL between real GPUs, gloo otherwise. ``launch`` starts
the processes: ``torch.multiprocessing`` (spawn) with a TCP rendezvous on 127.0.0.1, or, under
``torchrun`` (its ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), this process as one
rank, one command per node. A process that dies makes the others stop with one line, within
seconds when its connections close and within the run's timeout otherwise.

Knows nothing about how stages were chosen (``hetplan.pipeline``), the model math (the
backends') or the command line. No transport of its own: every byte between stages goes
through ``torch.distributed`` (the local launcher receives the last stage's result through a
``multiprocessing`` queue).
"""
