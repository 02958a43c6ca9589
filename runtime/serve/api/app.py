"""The routes: /v1/completions, /v1/chat/completions (whole or streamed as server-sent events),
/v1/models, /health and /metrics, over an engine stepping on its own thread.

A handler parses the body (``protocol``), turns the prompt into ids (a list of ints as given;
text through the tokenizer; chat messages through its chat template), submits the request and
waits for its tokens, which the engine thread hands over through ``call_soon_threadsafe``. A
prompt that cannot fit is 413, a full queue 429, any other mistake 400, each with OpenAI's
error body. A client that goes away (mid-stream or while waiting) cancels its request, which
frees its blocks. Knows nothing about tensors.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from hetplan.errors import HetplanError
from hetplan.runtime.serve import metrics
from hetplan.runtime.serve.api.protocol import ApiError, ChatRequest, CompletionRequest, parse
from hetplan.runtime.serve.engine import QueueFull, TooLong
from hetplan.runtime.serve.sampling import safe_prefix

COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""


def make_app(engine, model_name: str = "hetplan") -> Starlette:
    api = _Api(engine, model_name)
    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={ApiError: _error})


async def _error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status)


class _Api:
    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        return PlainTextResponse(metrics.render(self.engine), media_type="text/plain; version=0.0.4")

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                        "owned_by": "hetplan"}]})

    async def completions(self, request: HttpRequest):
        body = parse(await request.body(), CompletionRequest)
        ids = self._ids(body.prompt)
        return await self._run(request, body, ids, COMPLETION_MAX_TOKENS, chat=False)

    async def chat(self, request: HttpRequest):
        body = parse(await request.body(), ChatRequest)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, "/v1/chat/completions needs a chat template, and the weights directory has no "
                                "tokenizer with one; use /v1/completions, or serve weights with a tokenizer "
                                "whose tokenizer_config.json holds a chat_template", param="messages")
        ids = list(tok.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
        return await self._run(request, body, ids, self.engine.room_after(len(ids)), chat=True)

    def _ids(self, prompt) -> list:
        if isinstance(prompt, list):
            return prompt
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, "prompt: text needs a tokenizer, and there is no tokenizer beside the weights; send "
                                "the prompt as a list of token ids", param="prompt")
        return list(tok(prompt)["input_ids"])

    async def _run(self, request, body, ids: list, default_max: int, chat: bool):
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        try:
            params = body.sampling(default_max)
            req = self.engine.submit(ids, params, priority=body.priority,
                                     on_token=lambda r: loop.call_soon_threadsafe(updates.put_nowait, None))
        except TooLong as e:
            raise ApiError(413, str(e), param="prompt") from None
        except QueueFull as e:
            raise ApiError(429, str(e)) from None
        except HetplanError as e:
            raise ApiError(400, str(e)) from None
        reply = _Reply(self.engine, req, self.model_name, chat, len(ids))
        if body.stream:
            return StreamingResponse(self._stream(req, updates, reply), media_type="text/event-stream")
        try:
            while req.finish_reason is None:
                await updates.get()
        finally:  # a client gone before the end cancels its request (a no-op once finished)
            self.engine.cancel(req.rid)
        if req.finish_reason == "error":
            raise ApiError(500, f"the engine failed on this request: {req.error}")
        return JSONResponse(reply.whole())

    async def _stream(self, req, updates, reply):
        sent = ""
        try:
            if reply.chat:
                yield _sse(reply.chunk({"role": "assistant", "content": ""}, None))
            while True:
                await updates.get()
                done = req.finish_reason is not None
                text = self.engine.text(req)
                # held back until settled: a possible stop string's start, and a character whose
                # bytes are not all decoded yet (U+FFFD at the end)
                ready = text if done else safe_prefix(text, req.params.stop).rstrip("\ufffd")
                if len(ready) > len(sent):
                    delta = ready[len(sent):]
                    sent = ready
                    yield _sse(reply.chunk({"content": delta} if reply.chat else delta, None))
                if done and req.finish_reason == "error":
                    yield _sse(ApiError(500, f"the engine failed on this request: {req.error}").body())
                    yield "data: [DONE]\n\n"
                    return
                if done:
                    yield _sse(reply.chunk({} if reply.chat else "", req.finish_reason))
                    yield "data: [DONE]\n\n"
                    return
        finally:  # a client that disconnects mid-stream frees its blocks
            self.engine.cancel(req.rid)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Reply:
    """The OpenAI response objects of one request."""

    def __init__(self, engine, req, model: str, chat: bool, prompt_tokens: int):
        self.engine, self.req, self.model, self.chat = engine, req, model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def whole(self) -> dict:
        text = self.engine.text(self.req)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.req.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.req.finish_reason}
        n = len(self.req.generated)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                          "total_tokens": self.prompt_tokens + n}}

    def chunk(self, delta, finish_reason) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}
