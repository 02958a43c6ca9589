"""Request bodies of the OpenAI API as strict models, and the errors they turn into.

``/v1/completions`` takes ``prompt`` as text (needs a tokenizer) or as a list of token ids;
``/v1/chat/completions`` takes ``messages`` (rendered with the tokenizer's chat template).
Both take ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (a string or a list),
``stream``, ``n`` (1 only), ``user`` (ignored), ``priority`` (``interactive``, the
default, or ``batch``) and ``ignore_eos`` (generate to ``max_tokens`` past the end-of-sequence
token, as vLLM and llama-server take it); the last two are not part of OpenAI's API. Any other field is refused (400) by name,
as is a value of the wrong type. Knows nothing about the engine.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from hetplan.runtime.serve.sampling import SamplingParams


class ApiError(Exception):
    """An HTTP error with OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 413: "context_length_exceeded", 429: "rate_limit_exceeded"}
        return {"error": {"message": self.message, "type": kind.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1)
    user: str | None = None
    priority: str = Field(default="interactive", pattern="^(interactive|batch)$")
    ignore_eos: StrictBool = False

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_tokens or max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: str | list[StrictInt]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(pattern="^(system|user|assistant|tool|developer)$")
    content: str
    name: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


def parse(raw: bytes, cls):
    """The body as ``cls``, or an ApiError 400 naming what is wrong and where."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(cls.model_fields))
            raise ApiError(400, f"unknown field {where!r}; this server accepts: {known}", param=where) from None
        if err["type"] == "missing":
            raise ApiError(400, f"missing field {where!r}", param=where) from None
        raise ApiError(400, f"field {where!r}: {err['msg']}", param=where) from None
