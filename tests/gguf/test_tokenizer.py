"""A GGUF file's own tokenizer (``tokenizer.ggml.*``) serves ``hetplan exec --prompt``.

The file carries a byte-level BPE tokenizer with no merges (``tests.gguf.files.byte_tokens``),
so the ids of a text are its UTF-8 bytes: the run with ``--prompt`` must equal the run with those
ids, and the generated text must decode from the generated ids byte by byte.
"""

from __future__ import annotations

import pytest

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.runtime.session import RunOptions, run_plan
from tests.gguf.files import write_model

TEXT = "hello, world"


@pytest.fixture()
def plan_of(node):
    def make(path):
        return compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu",
                                           prompt_len=len(TEXT), gen_len=4))[0]
    return make


def test_prompt_text_is_tokenised_by_the_files_tokenizer(tmp_path, plan_of):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", tokenizer=True)
    plan = plan_of(path)
    by_text = run_plan(plan, RunOptions(weights=str(path), prompt=TEXT, gen_len=4, emulate=True))
    ids = tuple(TEXT.encode())
    by_ids = run_plan(plan, RunOptions(weights=str(path), prompt_ids=(ids,), gen_len=4, emulate=True))
    assert by_text.tokens == by_ids.tokens
    assert by_text.text[0] == bytes(by_text.tokens[0]).decode("utf-8")   # token i is byte i


def test_a_file_without_a_tokenizer_asks_for_ids(tmp_path, plan_of):
    path = tmp_path / "m.gguf"
    write_model(path, "llama")
    with pytest.raises(HetplanError, match="no tokenizer .* in the GGUF file"):
        run_plan(plan_of(path), RunOptions(weights=str(path), prompt=TEXT, gen_len=4, emulate=True))
