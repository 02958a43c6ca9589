"""``hetplan serve`` over a pipeline plan: one process per stage, continuous batching across them.

Stage 0's process runs the HTTP server and the engine (``engine``: the scheduler of each group
of requests, the block allocator, sampling, the tokenizer) and computes stage 0's blocks; every
other stage's process (``stage``) receives each step, computes its blocks and passes the hidden
state on, the last one sending the logits of the step back to stage 0. The requests and the KV
blocks are split into one group per stage (``groups``), whose steps are in flight at once, so
that every stage can compute while the others do. A step's message (``messages``) carries the
block tables stage 0's allocator decided and the block copies its swaps made, so every stage's
pool holds each request in the same blocks. ``launch`` starts the processes as ``hetplan exec``
does (``hetplan.runtime.distributed``). Knows nothing about HTTP beyond what ``Engine`` offers.
"""
