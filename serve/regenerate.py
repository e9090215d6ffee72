"""Regenerate the assistant turns of a conversation file with the target itself, so that a draft head
learns the target's own distribution rather than another model's.

    python -m eyas.serve.regenerate --data sharegpt --target smollm2-135m-instruct --output regen.jsonl
    python -m eyas.serve.regenerate --data chats.jsonl --endpoint http://127.0.0.1:8000/v1 --model my-model ...

Turn by turn: assistant turn j is rewritten from the conversation's earlier (already rewritten) turns.
`--batch-size` conversations are in flight at once, each with at most one pending reply; as soon as a reply
comes back its conversation asks for its next turn, and a finished conversation is written and replaced by
the next one (no turn waits for the others). Replies come from eyas's engine in-process (continuous
batching) or from any OpenAI-compatible endpoint (concurrent requests). The output is OpenAI `messages`
JSONL, one line per conversation with its index in the input (`{"index": i, "messages": [...]}`), in the
order conversations finish; a rerun skips the indices already written, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.common.assets import resolve_asset, resolve_target
from eyas.common.target import TargetModel, default_dtype
from eyas.data.conversations import Conversation, read_conversations
from eyas.data.tokenizer import load_tokenizer, render_chat, stop_token_ids

from .attention import add_engine_arguments, engine_options
from .engine import Engine, EngineConfig, Request
from .sampling import SamplingParams


class Replier:
    """Answers prompts (conversations ending with a user turn) asynchronously: `submit` returns a handle,
    `collect` waits until at least one submitted prompt is answered and returns the answered (handle, text)
    pairs. An empty text ends its conversation."""

    def submit(self, prompt: Conversation) -> object:
        raise NotImplementedError

    def collect(self) -> list[tuple[object, str]]:
        raise NotImplementedError


class EngineReplier(Replier):
    """In-process: every pending prompt is a request of one engine, decoded in one continuous batch. A prompt
    longer than `max_prompt_tokens` (past what training keeps) or the context gets an empty reply."""

    def __init__(self, engine: Engine, tokenizer, params: SamplingParams, max_new_tokens: int,
                 max_prompt_tokens: int | None = None):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_new_tokens, self.max_prompt_tokens = max_new_tokens, max_prompt_tokens
        self.stops = set(stop_token_ids(tokenizer))
        self.pending: list[Request] = []
        self.refused: list[object] = []  # handles answered "" without running

    def submit(self, prompt: Conversation) -> object:
        ids = render_chat(self.tokenizer, prompt)
        budget = min(self.max_new_tokens, self.engine.room(len(ids)))
        if budget <= 0 or (self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens):
            handle = object()
            self.refused.append(handle)
            return handle
        request = self.engine.add_request(ids, self.params, budget, self.stops)
        self.pending.append(request)
        return request

    def collect(self) -> list[tuple[object, str]]:
        done = [(handle, "") for handle in self.refused]
        self.refused = []
        while not done and self.pending:
            self.engine.step()
            finished = [r for r in self.pending if r.finished]
            if finished:
                self.pending = [r for r in self.pending if not r.finished]
                done += [(r, self.tokenizer.decode(r.content).strip()) for r in finished]
        return done


class EndpointReplier(Replier):
    """Through any OpenAI-compatible endpoint, one HTTP request per pending prompt."""

    def __init__(self, base_url: str, model: str, params: SamplingParams, max_new_tokens: int, concurrency: int):
        import httpx

        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=600)
        self.body = {"model": model, "max_tokens": max_new_tokens, "temperature": params.temperature,
                     "top_p": params.top_p}
        self.pool = ThreadPoolExecutor(concurrency)
        self.pending: set[Future] = set()

    def _one(self, prompt: Conversation) -> str:
        response = self.client.post("/chat/completions", json={**self.body, "messages": prompt})
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"].strip()

    def submit(self, prompt: Conversation) -> object:
        future = self.pool.submit(self._one, prompt)
        self.pending.add(future)
        return future

    def collect(self) -> list[tuple[object, str]]:
        done, self.pending = wait(self.pending, return_when=FIRST_COMPLETED)
        return [(future, future.result()) for future in done]


class Rewrite:
    """One conversation's assistant turns rewritten in order: `prompt` gives the next turn's prompt (None
    when done), `answer` records its reply (an empty one ends the conversation), `result` the rewrite."""

    def __init__(self, source: Conversation):
        self.source, self.out, self.turn = source, [], 0

    def prompt(self) -> Conversation | None:
        while self.turn < len(self.source):  # copy the turns before the next assistant turn
            message = self.source[self.turn]
            if message["role"] == "assistant":
                return list(self.out)
            self.out.append(dict(message))
            self.turn += 1
        return None

    def answer(self, text: str) -> None:
        if text:
            self.out.append({"role": "assistant", "content": text})
            self.turn += 1
        else:
            self.turn = len(self.source)

    def result(self) -> Conversation:
        """The rewrite, without a dangling user turn left where a reply came back empty."""
        return self.out[:-1] if self.out and self.out[-1]["role"] != "assistant" else self.out


def regenerate(conversations: Iterable[tuple[int, Conversation]], replier: Replier, in_flight: int
               ) -> Iterator[tuple[int, Conversation]]:
    """Yields (index, rewritten conversation) as each finishes, keeping `in_flight` conversations pending."""
    source = iter(conversations)
    active: dict[object, tuple[int, Rewrite]] = {}
    finished: list[tuple[int, Conversation]] = []

    def advance(index: int, rewrite: Rewrite) -> None:
        prompt = rewrite.prompt()
        if prompt is None:
            finished.append((index, rewrite.result()))
        else:
            active[replier.submit(prompt)] = (index, rewrite)

    while True:
        while len(active) < in_flight and (item := next(source, None)) is not None:
            advance(item[0], Rewrite(item[1]))
        yield from finished
        finished.clear()
        if not active:
            return
        for handle, text in replier.collect():
            index, rewrite = active.pop(handle)
            rewrite.answer(text)
            advance(index, rewrite)


def regenerate_file(data: str | Path, output: Path, replier: Replier, batch_size: int = 64,
                    limit: int | None = None, shard: tuple[int, int] = (0, 1)) -> int:
    """Regenerates the conversations of `data` (a file or packaged data set name) into `output` (JSONL,
    appended; indices already there are skipped), `batch_size` conversations in flight. `shard` (i, n) takes
    the conversations whose index is i modulo n (one process per GPU). Returns the number written."""
    path = resolve_asset(data)
    done = set()
    if output.exists():
        for line in output.read_text().splitlines():
            try:
                done.add(json.loads(line)["index"])
            except (json.JSONDecodeError, KeyError):
                break  # a line cut by an interruption: everything before it stands
    i_shard, n_shards = shard
    pending = ((i, c) for i, c in enumerate(islice(read_conversations(path), limit))
               if i % n_shards == i_shard and i not in done)
    written = 0
    with open(output, "a") as f, tqdm(desc="regenerating", unit="conv", initial=len(done), total=limit) as bar:
        for index, messages in regenerate(pending, replier, batch_size):
            if any(m["role"] == "assistant" for m in messages):
                f.write(json.dumps({"index": index, "messages": messages}) + "\n")
                f.flush()
                written += 1
            bar.update(1)
    return written


def parse_shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.regenerate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data", required=True, help="conversation file, or a packaged data set (sharegpt)")
    parser.add_argument("--output", type=Path, required=True, help="JSONL to write (resumed if it exists)")
    parser.add_argument("--target", help="HF directory, .gguf file or packaged model name (in-process)")
    parser.add_argument("--endpoint", help="an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="default", help="the model name sent to --endpoint")
    parser.add_argument("--limit", type=int, help="regenerate only the first N conversations")
    parser.add_argument("--batch-size", type=int, default=64, help="conversations in flight at once")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-prompt-tokens", type=int,
                        help="end a conversation before a turn whose prompt is longer (e.g. training's max_length)")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="take conversations I, I+N, I+2N, ... (e.g. 0/2 and 1/2 on two GPUs)")
    add_engine_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    params = SamplingParams(temperature=args.temperature)
    if (args.target is None) == (args.endpoint is None):
        parser.error("give exactly one of --target (in-process) and --endpoint")
    if args.endpoint:
        replier = EndpointReplier(args.endpoint, args.model, params, args.max_new_tokens, args.batch_size)
    else:
        path = resolve_target(args.target)
        dtype = default_dtype(args.device)
        target = TargetModel.from_pretrained(path, dtype=dtype, device=args.device)
        config = EngineConfig(speculative=False, max_batch_size=args.batch_size, **engine_options(args))
        engine = Engine(target, None, config)
        replier = EngineReplier(engine, load_tokenizer(path), params, args.max_new_tokens, args.max_prompt_tokens)
    n = regenerate_file(args.data, args.output, replier, args.batch_size, args.limit, args.shard)
    print(f"wrote {n} conversations to {args.output}")


if __name__ == "__main__":
    main()
