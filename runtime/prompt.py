"""The tokens going in and coming out: the prompt as ids, and the next token from logits.

A prompt is given as ids (one sequence, repeated over the plan's batch, or one per sequence of
equal length), as text (tokenised with the tokenizer stored beside the weights), or not at all
(seeded random ids, as many as the plan's ``prompt_len``). Sampling is greedy or from
softmax(logits / temperature) with a seeded generator. Knows nothing about plans' placement.
"""

from __future__ import annotations

import torch

from hetplan.errors import HetplanError


def parse_prompt_ids(text: str) -> tuple:
    """``1,2,3`` (one sequence) or ``1,2,3;4,5,6`` (one per sequence) -> tuple of tuples."""
    try:
        seqs = tuple(tuple(int(x) for x in part.split(",")) for part in text.split(";"))
    except ValueError:  # also an empty item: "1,,2", "1,"
        raise HetplanError(f"--prompt-ids {text!r}: expected comma-separated integers, sequences "
                           f"separated by ';' (e.g. 1,2,3 or 1,2;3,4)") from None
    if not seqs or any(not s for s in seqs):
        raise HetplanError(f"--prompt-ids {text!r}: a sequence is empty")
    return seqs


def load_tokenizer(source):
    """The tokenizer inside the weights file (a GGUF's) or beside a checkpoint (transformers'
    AutoTokenizer), or None."""
    own = getattr(source, "tokenizer", None)
    if own is not None:
        return own()
    directory = source.tokenizer_dir()
    if directory is None:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(directory))


def resolve_prompt(opts, source, spec, wl) -> tuple[torch.Tensor, object]:
    """-> (ids int64 [B, P], tokenizer or None)."""
    if opts.prompt is not None and opts.prompt_ids is not None:
        raise HetplanError("--prompt and --prompt-ids: give one of them")
    tokenizer = load_tokenizer(source)
    if opts.prompt is not None:
        if tokenizer is None:
            raise HetplanError("--prompt: no tokenizer beside the weights (tokenizer.json) or in the GGUF "
                               "file (tokenizer.ggml.*); pass --prompt-ids instead")
        seqs = (tuple(tokenizer(opts.prompt)["input_ids"]),)
    elif opts.prompt_ids is not None:
        seqs = tuple(tuple(s) for s in opts.prompt_ids)
    else:
        g = torch.Generator().manual_seed(opts.seed)
        return torch.randint(0, spec.vocab, (wl.batch, wl.prompt_len), generator=g), tokenizer
    if len({len(s) for s in seqs}) != 1:
        raise HetplanError(f"--prompt-ids: sequences have lengths {[len(s) for s in seqs]}; they must be equal")
    if len(seqs) == 1:
        seqs = seqs * wl.batch
    if len(seqs) != wl.batch:
        raise HetplanError(f"--prompt-ids: {len(seqs)} sequences, but the plan's batch is {wl.batch}; give "
                           f"one sequence (repeated) or {wl.batch}")
    bad = [i for s in seqs for i in s if not 0 <= i < spec.vocab]
    if bad:
        raise HetplanError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary (0..{spec.vocab - 1})")
    return torch.tensor(seqs, dtype=torch.int64), tokenizer


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Next token per sequence from fp32 logits [B, V]: argmax when ``temperature`` is 0, else a
    draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
