"""A tiny random llama checkpoint, its plan, and transformers' greedy output for a prompt alone.

The model is ``tests.exec.test_numerics``'s llama (hidden 64, 2 layers, 4 heads over 2 KV
heads, vocab 128, llama3 rope scaling, weights std 0.2 so greedy choices are far from ties),
saved with ``save_pretrained``; the plan puts it all on the (emulated) GPU. Every engine
``engine_for`` makes is remembered (``ENGINES``, weakly) for ``tests/serve/conftest.py``'s
check of its GPU peak.
"""

from __future__ import annotations

import weakref

import torch

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.serve.load import load_engine
from hetplan.runtime.serve.settings import settings_for
from tests.exec.test_numerics import CPU_NODE, save_tiny_model
from tests.tiny_models import TINY_GPU_NODE

VOCAB = 128
CONTEXT = 96


def tiny_llama(tmp_path_factory, gpu: bool = True):
    """(transformers model, checkpoint dir, plan): the plan all on the (emulated) GPU, or, with
    ``gpu=False``, on a machine without one."""
    directory = tmp_path_factory.mktemp("serve-llama")
    model = save_tiny_model("llama", directory)
    node = tmp_path_factory.mktemp("node") / "node.yaml"
    node.write_text(TINY_GPU_NODE if gpu else CPU_NODE)
    req = CompileRequest(model=str(directory), hw=str(node), strategy="all-gpu" if gpu else "ilp",
                         weight_dtype="fp32", prompt_len=CONTEXT // 2, gen_len=CONTEXT // 2)
    return model, str(directory), compile_plan(req)[0]


ENGINES = weakref.WeakSet()
"""Every engine ``engine_for`` made that is still alive."""


def engine_for(plan, directory, **settings):
    engine = load_engine(plan, directory, settings_for(plan, **settings), emulate=True)
    ENGINES.add(engine)
    return engine


def greedy_alone(model, prompt: list, max_new: int) -> list:
    """transformers' greedy generate of ``max_new`` tokens for ``prompt`` alone."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def random_prompt(seed: int, length: int) -> list:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
