"""OpenAI-compatible HTTP API (FastAPI) over the engine worker.

    app = create_app(worker, tokenizer, model_name="smollm2")   # serve-eagle builds this
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints:
  POST /v1/chat/completions   model, messages, max_tokens | max_completion_tokens, temperature, top_p, top_k,
                              seed, stop, stream, stream_options.include_usage, n (1 only); user,
                              safety_identifier, prompt_cache_key, metadata, service_tier and
                              stream_options.include_obfuscation are ignored
  POST /v1/completions        the same with `prompt` instead of `messages`: a string or token ids, or a list of
                              one of them; max_tokens defaults to 16 there, as OpenAI's does
  GET  /v1/models, /v1/models/{model}, /metrics (Prometheus; see metrics.py)
  GET  /health                {"status": "ok"}, or a 503 {"status": "unavailable", "reason"} while shutting down
                              or when the engine thread is not running

OpenAI's options that this server does not implement (logprobs, top_logprobs, frequency_penalty, presence_penalty,
logit_bias; response_format, tools, store, reasoning_effort, audio and prediction of chats; echo, best_of and suffix of
completions) are accepted at the values that ask for nothing (false, 0, {}, [], {"type": "text"}, 1 for best_of,
null), else refused with a 400 whose code is "unsupported_parameter"; with no tools, tool_choice "none" or "auto" and
parallel_tool_calls ask for nothing, and modalities ["text"] asks for what is written anyway.
A "developer" message is a system message. A message's `name` goes to the chat template (most ignore it); the fields
the openai client writes back of an answer (`message.model_dump()`: refusal, tool_calls, ...) are taken at null.

A message's content is a string or a list of text parts, joined with "\\n"; other parts (images, audio) are a 400.
A max_tokens past the context's end stops there, with finish_reason "length".

Streaming answers are server-sent events (`data: {chunk}\\n\\n`, ending with `data: [DONE]\\n\\n`); with
`stream_options: {"include_usage": true}` (streaming only) a last chunk with empty `choices` carries `usage`, the
others `usage: null`. `stop` strings are matched on the decoded text; the output ends before the stop string,
with finish_reason "stop". Stop tokens (eos, end of turn) end the output too and are not shown. `top_k` is an
extension (0 or -1 = off). Both filters keep a tie at their cut whole (`sampling.nucleus_floor`).

Every response, and the last chunk of a stream, carries an extension field on speculative decoding:

    "eyas": {"verify_steps": 12, "accepted_tokens": 25, "acceptance_length": 3.08, "accepted_per_step": [3, 1, ...]}

verify_steps: target verification passes of this request; accepted_tokens: draft tokens they accepted
(accepted_per_step: how many at each verification, for per-position acceptance rates), whole where a stop token,
max_tokens or a stop string cut the output short of them: they measure the draft, not the text (but for the
verifications after the one that completed a stop string, which ran before the request's abort reached the engine);
acceptance_length: tokens per verification, (accepted_tokens + verify_steps) / verify_steps, the bonus token
counted, or null with no verification (speculation off, or the answer ended at its first token).

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, unknown
or mistyped fields, bad values, a prompt longer than the context; 404 for an unknown model or path; 503 while
shutting down, and for a request the shutdown aborted unfinished; 500 for one an engine failure ended (a stream ends
with an error event instead). A client that disconnects mid-stream has its request aborted (its KV blocks freed).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException
from transformers import PreTrainedTokenizerBase

from eyas.data.tokenizer import render_chat, stop_token_ids

from .engine import PromptTooLong
from .metrics import Metrics
from .sampling import SamplingParams
from .text import TextStream
from .worker import EngineWorker, Finish, ShuttingDown, Stream

# ---- request schemas ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    # Unknown fields are errors; no coercion ("1" is not an int, 1 is not a bool).
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _unicode(cls, value):
        """Text must be Unicode that encodes: JSON's "\\ud800" escape parses into a lone surrogate, which no
        tokenizer (nor an error message) takes."""
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("a lone UTF-16 surrogate (\\ud800-\\udfff) is not text") from None
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


_Nothing = Annotated[list, Field(max_length=0)] | None


class ChatMessage(_Strict):
    # "developer": OpenAI's newer name for the system role (its own examples send it); templates know "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None
    # What the openai client writes back of an answer it got (`message.model_dump()`), at null: none here has them.
    refusal: None = None
    audio: None = None
    function_call: None = None
    tool_calls: _Nothing = None
    annotations: _Nothing = None

    def for_template(self) -> dict:
        # Parts are separate blocks of text (vLLM joins them so too): "Hello" and "world" are not "Helloworld".
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text} | ({"name": self.name} if self.name is not None else {})


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no chunk carries OpenAI's padding field either way: ignored


# OpenAI options this server does not implement. Clients send them at the value that asks for nothing (false, 0, {}),
# which is accepted; any other value is a 400 naming the option, with OpenAI's code "unsupported_parameter".
_UNSUPPORTED = ("frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format",
                "tools", "store", "reasoning_effort", "audio", "prediction", "echo", "best_of", "suffix")


class _Generation(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: up to the context)")
    temperature: float = Field(1.0, ge=0, le=2, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    # int64, as the engine's draws take it (`sampling.position_uniforms`).
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    # `_stop_strings` turns every form, the default None included, into a list of strings.
    stop: str | list[str] | None = Field(None, validate_default=True, description="up to 4 non-empty stop strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="only 1 is supported")
    user: str | None = None  # an end user's id, for OpenAI's abuse monitoring: ignored
    frequency_penalty: float = 0.0  # _UNSUPPORTED, as are those below and the endpoints' own
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's schema lets these options be null, meaning their default; clients send it so (a completion's
        max_tokens: 16, not a chat's "up to the context")."""
        nullable = ("temperature", "top_p", "top_k", "n", "stream", "max_tokens") + _UNSUPPORTED
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if not (value is None and key in nullable)}
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator(*_UNSUPPORTED, check_fields=False)
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        default = cls.model_fields[info.field_name].get_default(call_default_factory=True)
        if value != default:
            raise PydanticCustomError("unsupported_parameter", "not supported by this server (send {default} or "
                                      "leave it out)", {"default": json.dumps(default)})
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > 4 or not all(strings):
            raise ValueError("stop takes at most 4 non-empty strings")
        return strings

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = False  # _UNSUPPORTED, as are those below but tool_choice and parallel_tool_calls
    top_logprobs: int = 0
    response_format: dict = Field(default_factory=lambda: {"type": "text"})
    tools: list = Field(default_factory=list)
    store: bool = False
    tool_choice: Literal["none", "auto"] | None = None  # with no tools, either answers in text
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # _UNSUPPORTED
    audio: dict | None = None  # _UNSUPPORTED
    prediction: dict | None = None  # _UNSUPPORTED
    modalities: list[Literal["text"]] | None = None  # text, all this server writes
    # What changes nothing generated here, ignored as `user` is: OpenAI's newer end-user id, a cache-routing hint (a
    # prompt's KV is not kept across requests), stored completions' tags (store is false) and the billing tier.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="text or token ids, or a list of one")
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate at most (OpenAI's default, 16)")
    logprobs: int | None = None  # _UNSUPPORTED (0 would ask for the chosen token's logprob)
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list) -> str | list[int]:
        """The prompt's text or token ids: OpenAI's lists of prompts answer each, n=1 only one."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt a request is supported, got a list of {len(prompt)}")
            prompt = prompt[0]
        return prompt


# ---- errors -------------------------------------------------------------------------------------------


def _error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error(status: int, *args, **kwargs) -> JSONResponse:
    return JSONResponse(_error_body(*args, **kwargs), status)


class APIError(Exception):
    def __init__(self, status: int, message: str, *args, **kwargs):
        super().__init__(message)
        self.status, self.body = status, _error_body(message, *args, **kwargs)


_TYPE_TAGS = {"str", "int", "float", "bool"}


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """The first problem, naming its field: "messages.0.role: Input should be 'system', 'user' or 'assistant'"."""
    errors = exc.errors()
    # A value that fits no member of a union fails once per member: the deepest failure is the telling one (the
    # bad text part of a list, not "content: not a string").
    first = max(errors, key=lambda e: len(e["loc"]))
    # Loc parts that name union members ("str", "list[TextPart]", "function-after[...]") are not fields.
    loc = [str(part) for part in first["loc"] if part != "body" and part not in _TYPE_TAGS and "[" not in str(part)]
    if first["type"] == "json_invalid":
        return _error(400, f"malformed JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        if isinstance(exc.body, bytes):  # not parsed: FastAPI reads JSON only when the content-type says so
            return _error(400, "the request body must be JSON, sent with the header content-type: application/json")
        return _error(400, f"the request body must be a JSON object ({first['msg']})")
    field = ".".join(loc)
    message = f"unknown field '{field}'" if first["type"] == "extra_forbidden" else f"{field}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return _error(400, message, param=loc[0], code=first["type"])


# ---- generation ---------------------------------------------------------------------------------------

# Finishes that are no answer, with the status and error type a client gets instead (in a stream, an error event):
# OpenAI has no finish_reason for them. A request aborted while its client still reads was aborted by the shutdown
# (a client that left reads nothing); one whose stop string was found first has its answer ("stop").
_NO_ANSWER = {"error": (500, "server_error"), "abort": (503, "service_unavailable")}


class Generation:
    """One request's text: `pieces()` yields the text to show; then `reason`, `completion_tokens`, `stats`."""

    def __init__(self, worker: EngineWorker, stream: Stream, text: TextStream, stop_ids: set[int]):
        self.worker, self.stream, self.text, self.stop_ids = worker, stream, text, stop_ids
        self.completion_tokens = 0
        self.finish: Finish | None = None
        self.verified: int | None = None  # with a stop string: the verifications up to the one that completed it

    async def pieces(self) -> AsyncIterator[str]:
        try:
            while not isinstance(event := await self.stream.events.get(), Finish):
                # With stop strings, token by token: the count ends at the token that completes one, whether a step
                # gave one token or (speculating) several.
                for ids in ([t] for t in event.ids) if self.text.stop else (event.ids,):
                    self.completion_tokens += len(ids)
                    if piece := self.text.push([t for t in ids if t not in self.stop_ids]):
                        yield piece
                    if self.text.stopped:
                        break
                if self.text.stopped:  # a stop string: end the request, wait for its finish
                    self.verified = event.verified  # steps may run until the abort reaches the engine
                    self.worker.abort(self.stream, reason="stop")
                    while not isinstance(event := await self.stream.events.get(), Finish):
                        pass
                    break
            self.finish = event
            if rest := self.text.finish():
                yield rest
        finally:
            if self.finish is None:  # the client went away (cancelled) or the consumer stopped
                self.worker.abort(self.stream)

    @property
    def reason(self) -> str:
        return "stop" if self.text.stopped else self.finish.reason

    def usage(self, prompt_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens}

    def stats(self) -> dict:
        per_step = self.finish.accepted[: self.verified]  # all where no stop string ended the text
        steps, accepted = len(per_step), sum(per_step)
        return {"verify_steps": steps, "accepted_tokens": accepted,
                "acceptance_length": round((accepted + steps) / steps, 4) if steps else None,
                "accepted_per_step": per_step}


def create_app(worker: EngineWorker, tokenizer: PreTrainedTokenizerBase, model_name: str) -> FastAPI:
    """The app; its lifespan starts the worker and, at exit, shuts it down (running requests finish first).
    /metrics renders the worker's metrics."""
    metrics = worker.metrics
    stop_ids = set(stop_token_ids(tokenizer))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.shutdown()

    app = FastAPI(title="eyas", summary="OpenAI-compatible server with EAGLE-3 speculative decoding",
                  lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(APIError)
    async def on_api_error(request, exc: APIError):
        return JSONResponse(exc.body, exc.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request, exc: HTTPException):  # its headers: a 405's Allow
        body = _error_body(str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_internal_error(request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def start(body: _Generation, prompt: list[int], prompt_field: str) -> Generation:
        params = SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)  # in range: the schema's
        max_new = body.new_tokens or worker.engine.context_limit  # the engine also stops at the context's end
        try:
            stream = await worker.submit(prompt, params, max_new, stop_ids)
        except ValueError as e:  # a prompt too long gets OpenAI's code for it: clients can tell it from a bad one
            code = "context_length_exceeded" if isinstance(e, PromptTooLong) else None
            raise APIError(400, f"{prompt_field}: {e}", param=prompt_field, code=code) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return Generation(worker, stream, TextStream(tokenizer, body.stop, prompt), stop_ids)

    async def respond(request: Request, body: _Generation, prompt: list[int], gen: Generation, chat: bool):
        kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        head = {"id": f"{kind[0]}-{uuid.uuid4().hex}", "object": kind[1], "created": int(time.time()),
                "model": model_name}

        def choice(text: str | None, reason: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if not body.stream:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": reason}
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

        if not body.stream:
            text = await _unless_disconnected(request, _join(gen.pieces()))
            if text is None:
                return Response(status_code=499)  # nobody reads it; the request was aborted
            if failed := _NO_ANSWER.get(gen.reason):
                raise APIError(failed[0], gen.finish.error, failed[1])
            return {**head, "choices": [choice(text, gen.reason)], "usage": gen.usage(len(prompt)),
                    "eyas": gen.stats()}

        chunk_head = {**head, "object": "chat.completion.chunk"} if chat else head
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def event(data: dict) -> str:  # with include_usage every chunk has `usage`: null but on the last one
            return f"data: {json.dumps({**chunk_head, **({'usage': None} if include_usage else {}), **data})}\n\n"

        async def sse() -> AsyncIterator[str]:
            if chat:
                yield event({"choices": [choice(None, None, first=True)]})
            async for piece in gen.pieces():
                yield event({"choices": [choice(piece, None)]})
            if failed := _NO_ANSWER.get(gen.reason):
                yield f"data: {json.dumps(_error_body(gen.finish.error, failed[1]))}\n\n"
            elif include_usage:
                yield event({"choices": [choice(None, gen.reason)]})
                yield event({"choices": [], "usage": gen.usage(len(prompt)), "eyas": gen.stats()})
            else:
                yield event({"choices": [choice(None, gen.reason)], "eyas": gen.stats()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if tokenizer.chat_template is None:
            raise APIError(400, "messages: this model has no chat template; send a prompt to /v1/completions",
                           param="messages")
        try:
            prompt = render_chat(tokenizer, [m.for_template() for m in body.messages])
        except TemplateError as e:
            raise APIError(400, f"messages: the chat template rejects them: {e}", param="messages") from None
        return await respond(request, body, prompt, await start(body, prompt, "messages"), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = tokenizer(body.prompt).input_ids  # with the tokenizer's BOS, if it adds one (as a template does)
        elif not all(0 <= i < len(tokenizer) for i in body.prompt):
            raise APIError(400, f"prompt: token ids lie in [0, {len(tokenizer)})", param="prompt")
        else:
            prompt = body.prompt
        return await respond(request, body, prompt, await start(body, prompt, "prompt"), chat=False)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "eyas"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # the openai client's models.retrieve; a name may hold "/" (org/model)
    async def model(name: str):
        check_model(name)
        return card

    @app.get("/health")
    async def health():  # a load balancer sends requests elsewhere on a 503
        if reason := worker.unavailable():
            return JSONResponse({"status": "unavailable", "reason": reason}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_CountResponses, metrics=metrics, paths={route.path for route in app.routes})
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn serving `app` for `worker`. On Ctrl-C or SIGTERM uvicorn refuses new connections and waits for the
    open ones before the app's lifespan ends; the worker is closed first, so that requests still running after
    `grace_s` seconds end with a 503 or a stream's error event and [DONE], not a connection uvicorn cuts (its own wait
    is the longer)."""

    def __init__(self, app: FastAPI, worker: EngineWorker, grace_s: float = 30.0, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=int(grace_s) + 10, **config))
        self.worker, self.grace_s = worker, grace_s

    async def shutdown(self, sockets=None) -> None:
        self.worker.close(self.grace_s)
        await super().shutdown(sockets)


async def _join(pieces: AsyncIterator[str]) -> str:
    return "".join([piece async for piece in pieces])


async def _unless_disconnected(request: Request, work) -> str | None:
    """Awaits `work`, or cancels it (aborting its request) and returns None if the client disconnects first.
    The body has been read, so the next ASGI message is the disconnect."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


class _CountResponses:
    """ASGI middleware: counts responses by endpoint (the route's template, e.g. /v1/models/{name}; a path no route
    matched as "other") and status code."""

    def __init__(self, app, metrics: Metrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                # Routing has put the matched route into this scope by now.
                template = getattr(scope.get("route"), "path", None)
                endpoint = template if template in self.paths else "other"
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
