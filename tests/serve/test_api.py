"""The OpenAI-compatible server, end to end: the official `openai` client against uvicorn on loopback, with a
tiny random target (6 layers of width 32, with SmolLM2's 49152-token vocabulary so that SmolLM2's real tokenizer
and chat template work) and a tiny random EAGLE-3 head. Also bad input, stop strings, disconnects, engine
failures and the worker's shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import itertools
import json
import random
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eyas.common.assets import asset_path
from eyas.common.target import TargetModel
from eyas.data.tokenizer import load_tokenizer
from eyas.serve.api import Generation, GracefulServer, create_app
from eyas.serve.clients import EndpointClient
from eyas.serve.engine import Engine, EngineConfig, TreeShape
from eyas.serve.sampling import SamplingParams
from eyas.serve.text import TextStream
from eyas.serve.worker import EngineWorker, Finish, ShuttingDown, Stream, Tokens
from tests.conftest import make_hf_model
from tests.serve.heads import random_head

MODEL = "tiny"
CONTEXT = 256
QUESTION = [{"role": "user", "content": "What is speculative decoding?"}]


@functools.cache
def tokenizer():
    return load_tokenizer(asset_path("smollm2-135m-instruct"))  # ~6 s: once per session


@functools.cache
def tiny_models() -> tuple[TargetModel, object]:
    hf = make_hf_model("llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       max_position_embeddings=CONTEXT)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        target = TargetModel.from_pretrained(tmp)
    return target, random_head(target, draft_vocab=512)


class Server:
    """uvicorn serving the tiny models in a thread, on a free loopback port, as serve-eagle does (`GracefulServer`,
    running requests given `grace_s` at shutdown)."""

    def __init__(self, speculative: bool = True, num_blocks: int = 128, tok=None, grace_s: float = 30.0):
        target, head = tiny_models()
        config = EngineConfig(speculative=speculative, tree=TreeShape(3, 2, 5), block_size=16, num_blocks=num_blocks)
        self.worker = EngineWorker(Engine(target, head, config))
        self.metrics = self.worker.metrics
        self.app = create_app(self.worker, tok or tokenizer(), MODEL)
        self.num_blocks, self.grace_s = num_blocks, grace_s

    def __enter__(self) -> Server:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = GracefulServer(self.app, self.worker, self.grace_s, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **kw)

    def metric(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def idle(self) -> bool:
        """The engine holds no request and every KV block is free. The worker updates the metrics before it
        sends a step's tokens, so this holds as soon as the last answer is in."""
        return self.metric("eyas_kv_blocks_free") == self.num_blocks and not self.metric("eyas_running_requests")

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until idle: after a client left, which the server notices (and aborts its request) on its own time."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            assert time.monotonic() < deadline, "the KV pool did not return to full"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


def extension(obj) -> dict:
    return obj.model_extra["eyas"]


def stream_chat(client, **kw) -> tuple[str, str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons[-1], chunks


def test_chat_streamed_equals_not_streamed(server):
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length") and full.model == MODEL
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stats = extension(full)
    steps = stats["accepted_per_step"]  # one count per verification
    assert stats["verify_steps"] == len(steps) > 0 and stats["accepted_tokens"] == sum(steps)
    assert stats["acceptance_length"] == pytest.approx(1 + sum(steps) / len(steps), abs=1e-4)

    streamed, reason, chunks = stream_chat(client, messages=QUESTION, max_tokens=24, temperature=0,
                                           stream_options={"include_usage": True})
    assert streamed == text and reason == full.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all("usage" in chunk.model_fields_set and chunk.usage is None for chunk in chunks[:-1])
    assert extension(chunks[-1]) == stats


def test_completion_streamed_equals_not_streamed(server):
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="The eyas is a young hawk", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The eyas is a young hawk", max_tokens=20,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert extension(chunks[-1]) == extension(full)  # without include_usage: on the finish chunk
    assert full.usage.completion_tokens > 0


def test_completion_prompt_gets_the_tokenizers_bos():
    """A raw completion prompt is tokenized as its tokenizer does by default: with a BOS where it adds one (Llama 3,
    Mistral; SmolLM2's adds none, so a copy is given one here)."""
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer())
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    assert tok("The eyas").input_ids[0] == 0
    with Server(speculative=False, num_blocks=32, tok=tok) as bos, contextlib.closing(bos.client()) as client:
        out = client.completions.create(model=MODEL, prompt="The eyas", max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == len(tok("The eyas").input_ids) == len(tokenizer()("The eyas").input_ids) + 1


def test_sampling_with_seed_is_reproducible(server):
    """A seed gives the same answer again, streamed or not; and the request is sampled (its temperature and seed
    reach the engine): another seed, or temperature 0, answers otherwise."""
    client = server.client()
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    first = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == first
    streamed, _, _ = stream_chat(client, **{k: v for k, v in kw.items() if k != "model"})
    assert streamed == first
    for other in (dict(seed=8), dict(temperature=0)):
        assert client.chat.completions.create(**kw | other).choices[0].message.content != first, other


def test_top_k_extension(server):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0,
                                         extra_body={"top_k": 1})
    greedy = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == greedy.choices[0].message.content  # top-1 sampling is greedy
    # Past the vocabulary, however large (the schema bounds it from below only): no filtering, and no error.
    huge = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=1.0,
                                          extra_body={"top_k": 2**70})
    assert huge.choices[0].finish_reason == "length"  # an engine error ends it otherwise


def test_stop_strings(server):
    client = server.client()
    text = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, temperature=0).choices[0].text
    assert len(text) > 12, text
    stop = text[8:11]
    expected = text[: text.index(stop)]
    cut = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, temperature=0,
                                    stop=[stop, "never-appears"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert server.idle()
    assert server.metric("eyas_requests_finished_total", reason="abort") == 0


def test_usage_counts_tokens_up_to_the_stop_string():
    """A speculative step hands several tokens at once; usage counts those up to the one that completes a stop
    string, as when each step gives one token."""
    tok = tokenizer()
    ids = tok("alpha beta gamma delta", add_special_tokens=False).input_ids
    stop = tok.decode(ids[1:2]).strip()  # completed by the second token

    class Worker:
        def abort(self, stream, reason="abort"):
            stream.events.put_nowait(Finish(reason, []))

    async def count(events):
        stream = Stream(asyncio.get_running_loop())
        for event in events:
            stream.events.put_nowait(Tokens(event, 0))
        gen = Generation(Worker(), stream, TextStream(tok, stop=[stop]), set())
        return "".join([piece async for piece in gen.pieces()]), gen.completion_tokens, gen.reason

    one_at_a_time = asyncio.run(count([[i] for i in ids]))
    text = tok.decode(ids)
    assert one_at_a_time == (text[: text.index(stop)], 2, "stop")
    assert asyncio.run(count([ids[:3], ids[3:]])) == one_at_a_time


def test_stats_end_at_the_verification_that_completed_the_stop_string():
    """Steps run until the stop string's abort reaches the engine: their verifications (in the Finish) are not the
    text's, and the statistics end at the one whose tokens completed the stop string; without a stop string they
    count every verification."""
    tok = tokenizer()
    ids = tok("alpha beta gamma delta", add_special_tokens=False).input_ids
    steps = [1, 0, 2, 1]  # a verification per event below, and one more run before the abort landed

    class Worker:
        def abort(self, stream, reason="abort"):
            stream.events.put_nowait(Finish(reason, steps))

    async def stats(stop):
        stream = Stream(asyncio.get_running_loop())
        for verified, token in enumerate(ids[:3], 1):
            stream.events.put_nowait(Tokens([token], verified))
        if not stop:
            stream.events.put_nowait(Finish("length", steps))
        gen = Generation(Worker(), stream, TextStream(tok, stop=stop), set())
        [piece async for piece in gen.pieces()]
        return gen.stats()

    cut = asyncio.run(stats([tok.decode(ids[1:2]).strip()]))  # completed by the second event
    assert cut == {"verify_steps": 2, "accepted_tokens": 1, "acceptance_length": 1.5, "accepted_per_step": [1, 0]}
    assert asyncio.run(stats([]))["accepted_per_step"] == steps


def test_endpoint_client_finds_the_served_model(server):
    """eval-eagle / regeneration through serve-eagle with no --model: the client sends the name the server lists,
    and reads the acceptance statistics."""
    client = EndpointClient(f"{server.url}/v1", None, SamplingParams(temperature=0), 4)
    (answer,) = client.answer([QUESTION])
    assert client.body["model"] == MODEL and answer.new_tokens > 0 and answer.accepted


def test_models_health_metrics(server):
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    exported = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
                for s in f.samples if not s.labels}
    assert exported["eyas_kv_blocks_free"] == server.num_blocks and exported["eyas_generation_tokens_total"] >= 4
    assert server.metric("eyas_http_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    # A path with a parameter counts under its route's template; a path no route matches, as "other".
    assert client.models.retrieve(MODEL).id == MODEL and httpx.get(f"{server.url}/v1/nowhere").status_code == 404
    assert server.metric("eyas_http_requests_total", endpoint="/v1/models/{name:path}", status="200") >= 1
    assert server.metric("eyas_http_requests_total", endpoint="other", status="404") >= 1
    assert server.metric("eyas_generation_tokens_total") >= 4
    assert server.metric("eyas_prompt_tokens_total") > 10
    assert server.metric("eyas_verify_steps_total") >= 1
    assert server.metric("eyas_acceptance_length_count") == server.metric("eyas_verify_steps_total")
    assert server.metric("eyas_queue_depth") == 0
    # The top bucket is the tree's depth (3) plus the bonus token.
    buckets = [s.labels["le"] for f in server.metrics.registry.collect() if f.name == "eyas_acceptance_length"
               for s in f.samples if s.name.endswith("_bucket")]
    assert buckets == ["1.0", "2.0", "3.0", "4.0", "+Inf"]


LONG_PROMPT = "hawk " * (2 * CONTEXT)
BAD = [  # (body, status, field named in the message, words in the message)
    ("{not json", 400, None, "malformed JSON"),
    ({"model": MODEL, "messages": QUESTION, "temprature": 0.5}, 400, "temprature", "unknown field"),
    ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": "8"}, 400, "max_tokens", "valid integer"),
    ({"model": MODEL, "messages": QUESTION, "stream": 1}, 400, "stream", "valid boolean"),
    ({"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    ({"model": MODEL}, 400, "messages", "required"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"model": MODEL, "messages": QUESTION, "max_completion_tokens": -3}, 400, "max_completion_tokens", "greater"),
    ({"model": MODEL, "messages": QUESTION, "n": 2}, 400, "n", "only n=1"),
    ({"model": MODEL, "messages": QUESTION, "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"model": MODEL, "messages": QUESTION, "top_p": 0}, 400, "top_p", "greater than 0"),
    ({"model": MODEL, "messages": QUESTION, "stop": ["a", ""]}, 400, "stop", "non-empty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages", "context"),
    ({"model": "gpt-4", "messages": QUESTION}, 404, "model", "does not exist"),
    ([1, 2], 400, None, "JSON object"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages", "surrogate"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400,
     "messages", "surrogate"),
    ({"model": "\ud800", "messages": QUESTION}, 400, "model", "surrogate"),
    ({"model": MODEL, "messages": QUESTION, "stop": ["\ud800"]}, 400, "stop", "surrogate"),
    ({"model": MODEL, "messages": QUESTION, "stop": 5}, 400, "stop", "stop: input should be a valid string"),
    ({"model": MODEL, "messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when stream is true"),
    ({"model": MODEL, "messages": QUESTION, "logprobs": True}, 400, "logprobs", "not supported by this server"),
    ({"model": MODEL, "messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs", "not supported"),
    ({"model": MODEL, "messages": QUESTION, "frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
    ({"model": MODEL, "messages": QUESTION, "logit_bias": {"42": -100}}, 400, "logit_bias", "not supported"),
    ({"model": MODEL, "messages": QUESTION, "seed": 2**64 - 1}, 400, "seed", "less than 9223372036854775808"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                              {"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     400, "messages", "content.1.type: input should be 'text'"),
]


@pytest.mark.parametrize("body, status, field, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(server, body, status, field, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == field and words.lower() in error["message"].lower(), error
    if field:
        assert field in error["message"]


def test_null_options_mean_their_defaults(server):
    """OpenAI's schema lets a client send null for temperature, top_p, n and stream."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
            "stream": None, "top_k": None}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_completion_with_null_max_tokens_takes_openai_default(server):
    """A completion's max_tokens at null is its default, 16 (it ran to the context's end); a chat's stays "up to
    the context"."""
    def usage(**options):
        body = {"model": MODEL, "prompt": "Once upon", "temperature": 0, **options}
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["text"]

    assert usage(max_tokens=None) == usage() and usage()[0] <= 16


def test_unsupported_options_at_values_that_ask_for_nothing_are_accepted(server):
    """Clients send OpenAI's options they do not use at their neutral values; other values are refused by name, with
    OpenAI's code."""
    neutral = {"logprobs": False, "top_logprobs": None, "frequency_penalty": 0, "presence_penalty": 0.0,
               "logit_bias": {}, "user": "user-1"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2,
                                                              **neutral})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                         "logprobs": None, "echo": False, "best_of": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for option, value in [("logprobs", 0), ("echo", True), ("best_of", 3), ("suffix", "x")]:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", option: value})
        error = r.json()["error"]
        assert r.status_code == 400 and (error["param"], error["code"]) == (option, "unsupported_parameter"), r.text
        assert error["message"].startswith(f"{option}: not supported by this server")
    with pytest.raises(openai.BadRequestError, match="logprobs: not supported"):
        server.client().chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True, top_logprobs=2)


def test_a_developer_message_is_a_system_message(server):
    """OpenAI's newer name for the system role, which its own examples send."""
    client = server.client()
    answers = [client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": role, "content": "Answer briefly."}, *QUESTION]) for role in ("developer", "system")]
    assert answers[0].usage == answers[1].usage and answers[0].choices[0].message == answers[1].choices[0].message


def test_text_parts_are_joined_by_newlines(server):
    """OpenAI's list form of content: its text parts are blocks of text, joined with "\\n" (as vLLM does), not run
    together ("Helloworld")."""
    client = server.client()
    answers = [client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": content}]) for content in
        ([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}], "Hello\nworld")]
    assert answers[0].usage == answers[1].usage and answers[0].choices[0].message == answers[1].choices[0].message


def test_a_model_is_retrieved_by_its_name(server):
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_a_body_without_a_json_content_type_is_named_as_such(server):
    """curl -d sends a form's content type; FastAPI reads JSON only under a JSON one (no CSRF through plain forms)."""
    body = json.dumps({"model": MODEL, "messages": QUESTION})
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "content-type: application/json" in r.json()["error"]["message"], r.text


def test_chat_without_a_chat_template_is_a_client_error():
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = None
    with Server(tok=tok) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "no chat template" in r.json()["error"]["message"] and "/v1/completions" in r.json()["error"]["message"]
        assert s.client().completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_bad_completion_prompt(server):
    for prompt, words in [(LONG_PROMPT, "context"), ("", "empty"), ("hawk \ud800", "surrogate")]:
        r = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"model": MODEL, "prompt": prompt}),
                       headers={"content-type": "application/json"})  # json.dumps escapes a lone surrogate
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert (r.json()["error"]["code"] == "context_length_exceeded") == (prompt == LONG_PROMPT)  # what clients skip
        assert words in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="n=1"):
        server.client().completions.create(model=MODEL, prompt="x", n=3)
    r = httpx.get(f"{server.url}/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert server.idle()  # nothing leaked, still serving
    assert server.client().completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


@contextlib.contextmanager
def decoding_held(server, monkeypatch):
    """Holds the engine before its next decode step (a request's first token comes from its prefill) until the
    block has exited and the server has queued the abort, so the request cannot finish before the client leaves,
    however slow the machine."""
    engine, worker, release = server.worker.engine, server.worker, threading.Event()
    decode = engine._decode

    def held(requests, after=None):
        release.wait(10)
        return decode(requests, after)

    monkeypatch.setattr(engine, "_decode", held)
    aborted = server.metric("eyas_requests_finished_total", reason="abort")
    try:
        yield
        deadline = time.monotonic() + 10
        while worker._inbox.empty() and server.metric("eyas_requests_finished_total", reason="abort") == aborted:
            assert time.monotonic() < deadline, "the server did not notice the client leave"
            time.sleep(0.01)
    finally:
        release.set()


def test_client_disconnect_aborts_and_frees_blocks(server, monkeypatch):
    """The client leaves while its stream waits for the engine (decoding held: no token comes), and is noticed then,
    not at the next token: under ASGI spec < 2.4, which uvicorn declares, Starlette's StreamingResponse listens for
    the disconnect beside the stream and cancels it."""
    aborted = server.metric("eyas_requests_finished_total", reason="abort")
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": CONTEXT, "temperature": 1.0, "stream": True}
    with decoding_held(server, monkeypatch), httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("eyas_kv_blocks_free") < server.num_blocks  # the request holds blocks
    server.wait_idle()
    assert server.metric("eyas_requests_finished_total", reason="abort") == aborted + 1


def test_client_gone_before_its_stream_starts_aborts(server, monkeypatch):
    """A client that leaves before its stream's first event (here while its request is being queued) has its
    request aborted too: the stream starts on a connection already closed, and its cancellation aborts."""
    aborted = server.metric("eyas_requests_finished_total", reason="abort")
    queued, submit = threading.Event(), server.worker.submit

    async def slow_submit(*args, **kwargs):
        stream = await submit(*args, **kwargs)
        await asyncio.to_thread(queued.wait, 10)
        return stream

    monkeypatch.setattr(server.worker, "submit", slow_submit)
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": CONTEXT, "temperature": 1.0, "stream": True}
    with decoding_held(server, monkeypatch):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up before the response starts, and leaves
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
        queued.set()
    server.wait_idle()
    assert server.metric("eyas_requests_finished_total", reason="abort") == aborted + 1


def test_client_disconnect_without_streaming_aborts(server, monkeypatch):
    aborted = server.metric("eyas_requests_finished_total", reason="abort")
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": CONTEXT, "temperature": 1.0}
    with decoding_held(server, monkeypatch), pytest.raises(httpx.ReadTimeout):  # the client gives up and leaves
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    server.wait_idle()
    assert server.metric("eyas_requests_finished_total", reason="abort") == aborted + 1


def test_step_failure_ends_the_running_requests_only(server):
    engine = server.worker.engine

    def broken(requests, after=None):
        del engine._decode  # fail once: later steps use the class's method again
        raise RuntimeError("simulated kernel failure")

    engine._decode = broken
    with pytest.raises(openai.InternalServerError, match="simulated kernel failure"):
        server.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    assert server.idle()
    assert server.metric("eyas_requests_finished_total", reason="error") == 1
    out = server.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the simulated thread death
def test_health_is_503_while_shutting_down():
    """A load balancer reads /health: a worker shutting down is a 503 with the reason."""
    with Server(speculative=False, num_blocks=32) as s:
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}
        s.worker.shutdown()
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and r.json() == {"status": "unavailable", "reason": "the server is shutting down"}


def test_a_failed_engine_thread_ends_its_requests_and_refuses_new_ones(monkeypatch):
    """An exception outside `step` ends the engine thread: the request it held gets a 500, not a wait forever; later
    ones a 503, and /health names the failure."""
    with Server(speculative=False, num_blocks=32) as s:
        has_work = s.worker.engine.has_work

        def broken():  # fails once a request is in: outside `step`, where the worker does not catch it
            if has_work():
                raise RuntimeError("simulated failure outside a step")
            return False

        monkeypatch.setattr(s.worker.engine, "has_work", broken)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "simulated failure" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "simulated failure" in r.json()["error"]["message"]
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and r.json()["reason"].startswith("the engine thread failed: RuntimeError")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_shutdown_aborts_is_an_error(stream, monkeypatch):
    """A request still running at the shutdown's deadline is aborted while its client waits: that client gets a 503
    (in a stream, an error event), not the engine's finish reason "abort", which OpenAI does not have."""
    with Server(speculative=False, num_blocks=32) as s, ThreadPoolExecutor() as pool:
        worker, held_up, release, decode = s.worker, threading.Event(), threading.Event(), s.worker.engine._decode

        def held(requests, after=None):  # the request cannot finish before the shutdown's deadline
            held_up.set()
            release.wait(10)
            return decode(requests, after)

        monkeypatch.setattr(worker.engine, "_decode", held)
        body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 64, "stream": stream}
        answer = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=30)
        # Prefilled, the engine thread waits in the first decode step, reading no command until released (waiting
        # for the first token instead let the thread take the shutdown's command before the check below saw it).
        assert held_up.wait(10)
        stopping = pool.submit(worker.shutdown, 0.0)
        until(lambda: not worker._inbox.empty())  # the shutdown's deadline is queued, already past
        release.set()
        stopping.result(10)
        r = answer.result(10)
    assert '"abort"' not in r.text and s.metric("eyas_requests_finished_total", reason="abort") == 1
    if stream:
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        error = json.loads(r.text.split("data: ")[-2])["error"]
    else:
        assert r.status_code == 503
        error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "shut down" in error["message"], r.text


def test_stopping_the_server_ends_a_running_stream_with_an_error_event(monkeypatch):
    """Ctrl-C: uvicorn waits for open connections before the app's lifespan ends, so the worker is closed first and a
    stream still running after the grace period ends with an error event and [DONE] (uvicorn cut it before, after its
    own wait: a half-sent response); its KV blocks are freed."""
    with Server(speculative=False, num_blocks=32, grace_s=0.5) as s, ThreadPoolExecutor() as pool:
        decode = s.worker.engine._decode

        def slow(requests, after=None):  # a token every 50 ms: the answer outlasts the grace period
            time.sleep(0.05)
            return decode(requests, after)

        monkeypatch.setattr(s.worker.engine, "_decode", slow)
        body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 200, "stream": True, "temperature": 1.0}
        answer = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=30)
        until(lambda: s.metric("eyas_generation_tokens_total") > 0)
        s.server.should_exit = True
        r = answer.result(20)
        s.thread.join(20)
        assert not s.thread.is_alive()
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    error = json.loads(r.text.split("data: ")[-2])["error"]
    assert error["type"] == "service_unavailable" and "shut down" in error["message"], r.text
    assert s.idle()


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_speculation_off_serves_without_stats():
    with Server(speculative=False, num_blocks=32) as off, contextlib.closing(off.client()) as client:
        out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
        assert extension(out) == {"verify_steps": 0, "accepted_tokens": 0, "acceptance_length": None,
                                  "accepted_per_step": []}
    with Server() as on, contextlib.closing(on.client()) as client:  # the same greedy text with speculation
        spec = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
        assert spec.choices[0].message.content == out.choices[0].message.content


def test_text_stream_never_breaks_characters():
    tok = tokenizer()
    text = "Eyas 🦅 means a young hawk — jeune faucon, 幼鷹. Done."
    ids = tok(text, add_special_tokens=False).input_ids
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)

    stream = TextStream(tok, stop=["faucon"])
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text[: text.index("faucon")] and stream.stopped
    assert not any("fauc" in p for p in pieces)



@pytest.mark.parametrize("seed", range(4))
def test_text_stream_holds_back_only_what_may_begin_a_stop_string(seed):
    """Token by token, the text shown is the text so far up to the first stop string, less its longest end that
    begins one (a brute-force reference; stop strings that overlap themselves, as KMP's fallbacks must handle)."""
    tok = tokenizer()
    rng = random.Random(seed)
    letters = {c: tok.convert_tokens_to_ids(c) for c in "ab"}
    stops = rng.sample(["abab", "aab", "bba", "aaaa", "abaab", "b" * 9], 2)
    chars = "".join(rng.choice("ab") for _ in range(40))
    stream, shown = TextStream(tok, stop=stops), ""
    for t, c in enumerate(chars, start=1):
        shown += stream.push([letters[c]])
        text = chars[:t]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            assert shown + stream.finish() == text[: min(hits)] and stream.stopped, (stops, text)
            break
        held = max((k for k in range(1, len(text) + 1) for s in stops if k < len(s) and s.startswith(text[-k:])),
                   default=0)
        assert shown == text[: len(text) - held], (stops, text)


@functools.cache
def sentencepiece_style_tokenizer():
    """Llama 2's and Mistral's way of decoding, on SmolLM2's vocabulary size: a word's token carries its space as
    "▁", and the decoder strips the first space of a text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"▁w{i}": i + 3 for i in range(49152 - 3)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("▁[^▁]*"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_text_stream_decodes_the_first_tokens_after_the_prompt():
    """Decoded alone, a SentencePiece word loses its space: the prompt's last tokens give the first ones context."""
    tok = sentencepiece_style_tokenizer()
    prompt, (answer,) = tok("w1 w2").input_ids, tok("w3").input_ids
    assert tok.decode([answer]) == "w3" and tok.decode([*prompt, answer]) == "w1 w2 w3"
    assert TextStream(tok, prompt=prompt).push([answer]) == " w3"
    stream = TextStream(tok, stop=[" w3"], prompt=prompt)
    assert stream.push([answer]) + stream.finish() == "" and stream.stopped
    with Server(speculative=False, num_blocks=32, tok=tok) as s:
        out = s.client().completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, temperature=0)
    assert out.choices[0].text.startswith(" w") and out.usage.completion_tokens == 3, out


def test_text_stream_shows_a_character_the_prompt_began_with_the_answer():
    """Token ids that end inside a UTF-8 character (a byte-level token holding its first bytes): the answer's first
    token completes it, and the answer shows it whole."""
    tok = tokenizer()
    ids = tok("hawk 🦅 soars", add_special_tokens=False).input_ids
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    answer = tok.decode(ids)[len(tok.decode(ids[:cut]).rstrip("\ufffd")):]
    assert answer.startswith("🦅")
    stream = TextStream(tok, prompt=ids[:cut])
    assert "".join(stream.push([i]) for i in ids[cut:]) + stream.finish() == answer
    # A prompt's own "\ufffd" (typed, or a character the answer does not complete) stays the prompt's.
    hello = tok(" hello", add_special_tokens=False).input_ids
    for prompt in (ids[:cut], tok("what is \ufffd", add_special_tokens=False).input_ids):
        for stop in ([], ["\ufffd"]):
            stream = TextStream(tok, stop=stop, prompt=prompt)
            assert "".join(stream.push([i]) for i in hello) + stream.finish() == " hello" and not stream.stopped


def test_a_completion_prompt_in_openais_other_forms(server):
    """Token ids, or a list of one prompt (LangChain sends its prompts as a list); more than one is refused."""
    client = server.client()
    ids = tokenizer()("The eyas").input_ids
    outs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            for prompt in ("The eyas", ["The eyas"], ids, [ids])]
    assert all(out.choices[0].text == outs[0].choices[0].text and out.usage == outs[0].usage for out in outs)
    for prompt, words in [(["a", "b"], "one prompt a request"), ([ids, ids], "one prompt a request"),
                          ([49152], "token ids lie in [0, 49152)"), ([], "empty")]:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert words in r.json()["error"]["message"]


def test_a_completion_gets_openais_default_length(server):
    client = server.client()
    longer = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, temperature=0)
    assert longer.usage.completion_tokens > 16  # so the default is what stops the next one
    out = client.completions.create(model=MODEL, prompt="Once upon", temperature=0)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_an_answer_sent_back_as_the_client_dumps_it(server):
    """`message.model_dump()` holds refusal, tool_calls, ... at null: OpenAI takes it back as history."""
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    history = [*QUESTION, first.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    assert {"refusal", "tool_calls", "function_call"} <= set(history[1])
    assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=2).usage.completion_tokens == 2
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
        *QUESTION, {"role": "assistant", "content": "x", "refusal": "I can't."}]})
    assert r.status_code == 400 and "messages.1.refusal" in r.json()["error"]["message"], r.text


def test_a_message_name_reaches_the_template():
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = ("{% for m in messages %}{{ m.role }}{% if m.name %} named {{ m.name }}{% endif %}: "
                         "{{ m.content }}\n{% endfor %}")
    with Server(speculative=False, num_blocks=32, tok=tok) as s:
        usage = [s.client().chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "Hi", **name}]).usage.prompt_tokens for name in ({}, {"name": "Alice"})]
    texts = ("user: Hi\n", "user named Alice: Hi\n")
    assert usage == [len(tok(text, add_special_tokens=False).input_ids) for text in texts]


def test_tool_and_format_options_that_ask_for_nothing_are_accepted(server):
    neutral = {"response_format": {"type": "text"}, "tools": [], "store": False, "tool_choice": "none",
               "parallel_tool_calls": False, "reasoning_effort": None, "audio": None, "prediction": None,
               "modalities": ["text"]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2,
                                                              **neutral})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for option, value in [("response_format", {"type": "json_object"}), ("store", True),
                          ("tools", [{"type": "function", "function": {"name": "f"}}]), ("reasoning_effort", "high"),
                          ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content"})]:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, option: value})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text


def test_hints_that_change_nothing_generated_are_ignored(server):
    """OpenAI's newer end-user id, cache key, stored completions' tags, billing tier and stream obfuscation switch
    (which the openai client sends) are taken and ignored, as `user` is: the answer is the one without them."""
    plain = {"model": MODEL, "messages": QUESTION, "max_tokens": 3, "temperature": 0}
    hints = {"safety_identifier": "u1", "prompt_cache_key": "k", "metadata": {"run": "a"}, "service_tier": "auto"}
    answers = [httpx.post(f"{server.url}/v1/chat/completions", json=body) for body in (plain, plain | hints)]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"] == answers[1].json()["choices"]
    stream = server.client().chat.completions.create(**plain, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        answers[0].json()["choices"][0]["message"]["content"])


def test_a_wrong_method_names_the_allowed_one(server):
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json(), r.text

@pytest.mark.parametrize("grace, reason", [(30.0, "length"), (0.0, "abort")])
def test_worker_shutdown_finishes_or_aborts_in_flight(grace, reason):
    """Shutdown refuses new requests, lets running ones finish within the grace time (else aborts them), joins."""
    target, head = tiny_models()
    worker = EngineWorker(Engine(target, head, EngineConfig(block_size=16, num_blocks=32)))
    worker.start()

    async def run():
        stream = await worker.submit([1, 2, 3], SamplingParams(temperature=0), max_new_tokens=64)
        stopping = asyncio.create_task(asyncio.to_thread(worker.shutdown, grace))
        tokens = 0
        while not isinstance(event := await stream.events.get(), Finish):
            tokens += len(event.ids)
        await stopping
        with pytest.raises(ShuttingDown):
            await worker.submit([1, 2, 3], SamplingParams(), max_new_tokens=4)
        return event, tokens

    finish, tokens = asyncio.run(run())
    assert finish.reason == reason and (tokens == 64) == (reason == "length")
    assert not worker._thread.is_alive() and worker.engine.pool.allocator.num_free == 32


def test_an_abort_taken_with_the_shutdown_still_sends_its_finish():
    """The engine thread takes an abort (a stop string found in the text) in one batch of commands with the shutdown's
    stop: the request's Finish still leaves before the thread ends."""
    target, head = tiny_models()
    worker = EngineWorker(Engine(target, head, EngineConfig(block_size=16, num_blocks=32)))

    async def run():
        loop = asyncio.get_running_loop()
        stream, added = Stream(loop), loop.create_future()
        worker._inbox.put(("add", stream, ([1, 2, 3], SamplingParams(temperature=0), 64, frozenset()), added))
        worker.abort(stream, reason="stop")
        worker._inbox.put(("stop", None, time.monotonic() + 30, None))  # what `shutdown` queues
        worker.start()  # takes the three commands at once
        await asyncio.to_thread(worker._thread.join)
        await added
        return await asyncio.wait_for(stream.events.get(), 5)

    finish = asyncio.run(run())
    assert isinstance(finish, Finish) and finish.reason == "stop"
    assert worker.engine.pool.allocator.num_free == 32


def test_submitter_cancelled_while_queued_frees_its_request():
    """A submit cancelled before the engine thread took its request (the client left): the request is aborted
    once added, so it neither runs to its end nor keeps KV blocks."""
    target, head = tiny_models()
    worker = EngineWorker(Engine(target, head, EngineConfig(block_size=16, num_blocks=32)))

    async def run():
        submitting = asyncio.create_task(worker.submit([1, 2, 3], SamplingParams(temperature=0), max_new_tokens=64))
        await asyncio.sleep(0)  # the add is queued; the engine thread has not started
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting

    asyncio.run(run())
    worker.start()
    worker.shutdown(timeout=30.0)  # waits for whatever runs: an aborted request ends at once
    assert not worker.engine.has_work() and worker.engine.pool.allocator.num_free == 32
    assert worker.metrics.registry.get_sample_value("eyas_generation_tokens_total") == 0  # aborted before a step


def test_worker_updates_metrics_before_sending_events(monkeypatch):
    """Each event leaves the engine thread after its step's metrics: whoever has an answer reads them current."""
    target, head = tiny_models()
    worker = EngineWorker(Engine(target, head, EngineConfig(block_size=16, num_blocks=32)))
    sent = []  # (event, tokens generated and KV blocks free by the metrics as it leaves)
    put = Stream.put

    def recording_put(stream, event):
        value = worker.metrics.registry.get_sample_value
        sent.append((event, value("eyas_generation_tokens_total"), value("eyas_kv_blocks_free")))
        put(stream, event)

    monkeypatch.setattr(Stream, "put", recording_put)
    worker.start()

    async def run():
        stream = await worker.submit([1, 2, 3], SamplingParams(temperature=0), max_new_tokens=16)
        while not isinstance(await stream.events.get(), Finish):
            pass

    asyncio.run(run())
    worker.shutdown()
    deltas = [(len(event.ids), generated) for event, generated, _ in sent[:-1]]
    assert [generated for _, generated in deltas] == list(itertools.accumulate(n for n, _ in deltas))
    assert isinstance(sent[-1][0], Finish) and sent[-1][1:] == (16, 32)
