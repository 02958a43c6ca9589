"""``hetplan serve``: requests over HTTP, continuous batching over a paged KV pool.

``settings`` sizes the engine from a plan (or flags); ``blocks`` keeps the pool's block
accounting and ``pool`` holds the cache bytes per tier and copies blocks between tiers;
``model`` runs one batched forward over every scheduled request's own blocks; ``sampling``
turns logits into tokens; ``scheduler`` decides each step's batch; ``engine`` runs steps on a
thread of its own; ``metrics`` renders its counters; ``load`` builds it all from a plan and
weights; ``pipeline/`` serves a pipeline plan, one process per stage; ``api/`` speaks the OpenAI
API over Starlette and uvicorn. Only ``api/`` knows HTTP.
"""
