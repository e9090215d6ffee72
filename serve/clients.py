"""Answering chat prompts with the engine in-process or through an OpenAI-compatible endpoint, behind one
interface (eval-eagle and regeneration use both).

    client = EngineClient(engine, tokenizer, SamplingParams(temperature=0), max_new_tokens=256)
    client = EndpointClient("http://127.0.0.1:8000/v1", "my-model", SamplingParams(temperature=0), 256)
    answers = client.answer([messages_a, messages_b])   # answered together: an Answer each, None if refused
    handle = client.submit(messages_c)                  # or one by one, each collected as soon as it is answered
    client.collect()                                    # [(handle, Answer | None), ...]
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from eyas.data.conversations import Conversation
from eyas.data.tokenizer import render_chat, stop_token_ids

from .engine import Engine, Request
from .sampling import SamplingParams, for_prompt
from .text import decode_text

log = logging.getLogger(__name__)


@dataclass
class Answer:
    text: str
    new_tokens: int
    accepted: list[int]  # per verification, the draft tokens it accepted (empty without speculation statistics)


class Client:
    """Answers prompts (conversations ending with a user turn) asynchronously: `submit` returns a handle,
    `collect` waits until at least one submitted prompt is answered and returns the answered (handle, answer)
    pairs. An answer is None where the prompt was refused (no room left to answer it)."""

    def submit(self, prompt: Conversation) -> object:
        raise NotImplementedError

    def collect(self) -> list[tuple[object, Answer | None]]:
        raise NotImplementedError

    def answer(self, prompts: list[Conversation]) -> list[Answer | None]:
        """Answers `prompts` together (in-process: one continuous batch; a group of one is the latency setting)."""
        handles = [self.submit(prompt) for prompt in prompts]
        answers: dict[object, Answer | None] = {}
        while len(answers) < len(handles):
            answers.update(self.collect())
        return [answers[handle] for handle in handles]


class EngineClient(Client):
    """In-process: every pending prompt is a request of one engine, decoded in one continuous batch. A prompt
    that leaves no room in the context, or is longer than `max_prompt_tokens`, is refused without running.
    room_of: another engine whose room (`Engine.room`) bounds the answers too, so that a baseline answers what a
    speculative engine, which keeps more of its context free, can."""

    def __init__(self, engine: Engine, tokenizer, params: SamplingParams, max_new_tokens: int,
                 max_prompt_tokens: int | None = None, room_of: Engine | None = None):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_new_tokens, self.max_prompt_tokens = max_new_tokens, max_prompt_tokens
        self.engines = (engine,) if room_of is None else (engine, room_of)
        self.stops = set(stop_token_ids(tokenizer))
        self.pending: list[Request] = []
        self.refused: list[object] = []  # handles answered None without running

    def submit(self, prompt: Conversation) -> object:
        ids = render_chat(self.tokenizer, prompt)
        budget = min(self.max_new_tokens, *(engine.room(len(ids)) for engine in self.engines))
        if budget <= 0 or (self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens):
            handle = object()
            self.refused.append(handle)
            return handle
        request = self.engine.add_request(ids, for_prompt(self.params, prompt), budget, self.stops)
        self.pending.append(request)
        return request

    def collect(self) -> list[tuple[object, Answer | None]]:
        done: list[tuple[object, Answer | None]] = [(handle, None) for handle in self.refused]
        self.refused = []
        while not done and self.pending:
            self.engine.step()
            finished = [r for r in self.pending if r.finished]
            if finished:
                self.pending = [r for r in self.pending if not r.finished]
                done += [(r, Answer(decode_text(self.tokenizer, r.content).strip(), len(r.output), r.accepted))
                         for r in finished]
        return done


class EndpointError(RuntimeError):
    """An endpoint that cannot be reached or does not answer as an OpenAI chat server; the message names its URL."""


class EndpointClient(Client):
    """Through an OpenAI-compatible endpoint, one concurrent HTTP request per pending prompt (a seeded run's with the
    prompt's seed: `sampling.for_prompt`). A running `serve-eagle` also reports acceptance (its responses'
    `eyas.accepted_per_step`); other servers give the texts and token counts only. A prompt too long for the server's
    context (HTTP 400 that says so: `_too_long`) is refused here too, with a warning; any other failure raises. A reply
    whose content is null is an empty answer.
    `model` None: the first model the endpoint lists (serve-eagle serves one)."""

    def __init__(self, base_url: str, model: str | None, params: SamplingParams, max_new_tokens: int,
                 transport=None):
        import httpx

        self.base_url, self.params = base_url, params
        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=600, transport=transport)
        self.body = {"model": model or self._served_model(), "max_tokens": max_new_tokens,
                     "temperature": params.temperature, "top_p": params.top_p}
        if params.top_k > 0:  # an extension of the OpenAI API (serve-eagle's, vLLM's): sent only when it is used
            self.body["top_k"] = params.top_k
        self.pending: set[Future] = set()

    def _request(self, method: str, path: str, **kwargs):
        import httpx

        try:
            return self.client.request(method, path, **kwargs)
        except httpx.HTTPError as e:  # refused, unresolvable, timed out: httpx's message names no URL
            raise EndpointError(f"{self.base_url}: {method} {path} failed: {e}") from None

    def _served_model(self) -> str:
        response = self._request("GET", "/models")
        model = _field(response, lambda data: data["data"][0]["id"]) if response.status_code == 200 else None
        if not isinstance(model, str):
            hint = ("; an OpenAI-compatible base URL ends in /v1" if response.status_code == 404
                    and not str(self.base_url).rstrip("/").endswith("/v1") else "; name one with --model")
            raise EndpointError(f"{self.base_url}: GET /models gave HTTP {response.status_code} "
                               f"{response.text[:200]!r}, no model to send{hint}")
        return model

    def _one(self, prompt: Conversation) -> Answer | None:
        body = {**self.body, "messages": prompt}
        if (seed := for_prompt(self.params, prompt).seed) is not None:  # a seeded run's; else the server draws one
            body["seed"] = seed
        response = self._request("POST", "/chat/completions", json=body)
        # Only a prompt too long for the context is skipped: any other 400 (settings, a malformed conversation)
        # would fail every prompt alike.
        if response.status_code == 400 and _too_long(error := _error(response)):
            log.warning("%s refused the prompt %r, skipped: %s", self.base_url, prompt[-1]["content"][:60],
                        error.get("message"))
            return None
        if response.status_code != 200:
            raise EndpointError(f"{self.base_url}: HTTP {response.status_code}: {response.text[:500]}")
        # Content null (a reasoning model cut off while thinking, a refusal): an empty answer.
        answer = _field(response, lambda data: Answer(
            (data["choices"][0]["message"]["content"] or "").strip(), data["usage"]["completion_tokens"],
            (data.get("eyas") or {}).get("accepted_per_step") or []))
        if answer is None:
            raise EndpointError(f"{self.base_url}: POST /chat/completions gave HTTP 200 but not an OpenAI chat "
                               f"completion: {response.text[:500]!r}")
        return answer

    def submit(self, prompt: Conversation) -> object:
        future = Future()

        def run() -> None:
            try:
                future.set_result(self._one(prompt))
            except Exception as e:
                future.set_exception(e)

        # A daemon thread rather than a pool's: an interrupted run (Ctrl-C) exits at once instead of waiting
        # for the replies still in flight.
        threading.Thread(target=run, daemon=True).start()
        self.pending.add(future)
        return future

    def collect(self) -> list[tuple[object, Answer | None]]:
        done, self.pending = wait(self.pending, return_when=FIRST_COMPLETED)
        return [(future, future.result()) for future in done]


def _field(response, read):
    """read(the response's JSON), or None where the body is not JSON or not of the shape `read` expects (a page
    from a proxy, another API)."""
    try:
        return read(response.json())
    except (ValueError, LookupError, TypeError, AttributeError):
        return None


def _too_long(error: dict) -> bool:
    """Whether an OpenAI-shaped error blames the prompt's length: OpenAI's and serve-eagle's code, or vLLM's ("This
    model's maximum context length is ...") and SGLang's ("... longer than the model's context length") message."""
    return error.get("code") == "context_length_exceeded" or "context length" in str(error.get("message", "")).lower()


def _error(response) -> dict:
    """An OpenAI-shaped error body's `error` object ({} for any other body)."""
    error = _field(response, lambda data: data["error"])
    return error if isinstance(error, dict) else {}
