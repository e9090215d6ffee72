"""Regenerate the assistant turns of a conversation file with the target itself, so that a draft head
learns the target's own distribution rather than another model's.

    python -m eyas.serve.regenerate --data sharegpt --target smollm2-135m-instruct --output regen.jsonl
    python -m eyas.serve.regenerate --data chats.jsonl --endpoint http://127.0.0.1:8000/v1 --model my-model ...

Turn by turn: assistant turn j is rewritten from the conversation's earlier (already rewritten) turns, for
all conversations of a batch at once: in-process through eyas's engine (continuous batching), or through
any OpenAI-compatible endpoint (concurrent requests). The output is OpenAI `messages` JSONL, one line per
conversation with its index in the input (`{"index": i, "messages": [...]}`); a rerun skips the indices
already written, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.common.assets import ASSETS, asset_path, resolve_target
from eyas.common.target import TargetModel, default_dtype
from eyas.data.conversations import Conversation, read_conversations
from eyas.data.tokenizer import load_tokenizer, render_chat, stop_token_ids

from .attention import add_engine_arguments
from .engine import Engine, EngineConfig
from .sampling import SamplingParams

# Generates one reply for each prompt (a conversation ending with a user turn).
Replier = Callable[[list[Conversation]], list[str]]


def engine_replier(engine: Engine, tokenizer, params: SamplingParams, max_new_tokens: int,
                   max_prompt_tokens: int | None = None) -> Replier:
    """Replies in one continuous batch. A prompt longer than `max_prompt_tokens` (past what training keeps)
    or the context gets an empty reply, which ends its conversation."""
    stops = set(stop_token_ids(tokenizer))

    def reply(prompts: list[Conversation]) -> list[str]:
        requests = []
        for messages in prompts:
            ids = render_chat(tokenizer, messages)
            budget = min(max_new_tokens, engine.room(len(ids)))
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                budget = 0
            requests.append(engine.add_request(ids, params, budget, stops) if budget > 0 else None)
        while engine.has_work():
            engine.step()
        return [
            "" if r is None else tokenizer.decode([t for t in r.output if t not in stops]).strip() for r in requests
        ]

    return reply


def endpoint_replier(base_url: str, model: str, params: SamplingParams, max_new_tokens: int,
                     concurrency: int = 16) -> Replier:
    import httpx

    client = httpx.Client(base_url=base_url.rstrip("/"), timeout=600)

    def one(messages: Conversation) -> str:
        body = {"model": model, "messages": messages, "max_tokens": max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p}
        response = client.post("/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"].strip()

    def reply(prompts: list[Conversation]) -> list[str]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, prompts))

    return reply


def regenerate_batch(conversations: list[Conversation], reply: Replier) -> list[Conversation]:
    """Rewrites every assistant turn, turn index by turn index across the batch. A reply that comes back
    empty ends that conversation there (nothing after it is kept)."""
    out: list[Conversation] = [[] for _ in conversations]
    done = [False] * len(conversations)
    for turn in range(max(len(c) for c in conversations)):
        prompts, owners = [], []
        for i, conv in enumerate(conversations):
            if done[i] or turn >= len(conv):
                continue
            if conv[turn]["role"] != "assistant":
                out[i].append(dict(conv[turn]))
                continue
            prompts.append(out[i])
            owners.append(i)
        if not prompts:
            continue
        for i, text in zip(owners, reply(prompts), strict=True):
            if text:
                out[i].append({"role": "assistant", "content": text})
            else:
                done[i] = True
    # Drop a dangling user turn left where a reply came back empty.
    return [conv[:-1] if conv and conv[-1]["role"] != "assistant" else conv for conv in out]


def regenerate_file(data: str | Path, output: Path, reply: Replier, batch_size: int = 64,
                    limit: int | None = None, shard: tuple[int, int] = (0, 1)) -> int:
    """Regenerates the conversations of `data` (a file or packaged data set name) into `output` (JSONL,
    appended; indices already there are skipped). `shard` (i, n) takes the conversations whose index is i
    modulo n (one process per GPU). Returns the number of conversations written."""
    path = asset_path(str(data)) if str(data) in ASSETS else Path(data)
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
        while batch := list(islice(pending, batch_size)):
            for (index, _), messages in zip(batch, regenerate_batch([c for _, c in batch], reply), strict=True):
                if any(m["role"] == "assistant" for m in messages):
                    f.write(json.dumps({"index": index, "messages": messages}) + "\n")
                    written += 1
            f.flush()
            bar.update(len(batch))
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
    parser.add_argument("--batch-size", type=int, default=64)
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
        reply = endpoint_replier(args.endpoint, args.model, params, args.max_new_tokens)
    else:
        path = resolve_target(args.target)
        dtype = default_dtype(args.device)
        target = TargetModel.from_pretrained(path, dtype=dtype, device=args.device)
        config = EngineConfig(speculative=False, max_batch_size=args.batch_size, attention=args.attention,
                              cuda_graphs=not args.disable_cuda_graph)
        engine = Engine(target, None, config)
        reply = engine_replier(engine, load_tokenizer(path), params, args.max_new_tokens, args.max_prompt_tokens)
    n = regenerate_file(args.data, args.output, reply, args.batch_size, args.limit, args.shard)
    print(f"wrote {n} conversations to {args.output}")


if __name__ == "__main__":
    main()
