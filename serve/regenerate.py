"""Regenerate the assistant turns of a conversation file with the target itself, so that a draft head
learns the target's own distribution rather than another model's.

    python -m eyas.serve.regenerate --data sharegpt --target smollm2-135m-instruct --output regen.jsonl
    python -m eyas.serve.regenerate --data chats.jsonl --endpoint http://127.0.0.1:8000/v1 --model my-model ...

Turn by turn: assistant turn j is rewritten from the conversation's earlier (already rewritten) turns.
`--batch-size` conversations are in flight at once, each with at most one pending reply; as soon as a reply
comes back its conversation asks for its next turn, and a finished conversation is written and replaced by
the next one (no turn waits for the others). Replies come from eyas's engine in-process (continuous
batching) or from any OpenAI-compatible endpoint (concurrent requests). The output is OpenAI `messages` JSONL, one
line per conversation, `{"index": i, "place": "record 12", "messages": [...]}`, in the order conversations finish:
`index` counts the input's readable conversations from 0 (records the reader skips, named in its log, are not
counted), `place` is the record's line or number in the file. A conversation left without an assistant turn (its first
prompt refused or answered empty) is listed in `<output>.dropped` instead (`{"index": i}` lines). A rerun skips the
indices in either file, so an interrupted run resumes where it stopped (delete the `.dropped` file to ask for those
again, say with a larger `--max-prompt-tokens`). `<output>.source` records which `--data` the indices count (its size
and the hash of its first MiB): a rerun with another refuses to resume.
Ctrl-C (or `timeout -s INT`) stops it with exit code 130 and every finished conversation written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from eyas.common.assets import resolve_asset, resolve_asset_argument
from eyas.common.cli import HelpFormatter
from eyas.data.conversations import DECOMPRESSORS, Conversation, ConversationError, read_placed_conversations

from .clients import Client, EndpointClient, EndpointError, EngineClient
from .commands import (
    add_device_argument,
    add_engine_arguments,
    add_sampling_arguments,
    engine_options,
    given_flags,
    load_models_for,
    refuse_unread,
    require_output_dirs,
    require_positive,
    sampling_params,
)
from .engine import Engine, EngineConfig


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


def regenerate(conversations: Iterable[tuple[object, Conversation]], client: Client, in_flight: int
               ) -> Iterator[tuple[object, Conversation]]:
    """Yields (key, rewritten conversation) as each finishes, keeping `in_flight` conversations pending.
    A refused prompt ends its conversation."""
    source = iter(conversations)
    active: dict[object, tuple[int, Rewrite]] = {}
    finished: list[tuple[int, Conversation]] = []

    def advance(index: int, rewrite: Rewrite) -> None:
        prompt = rewrite.prompt()
        if prompt is None:
            finished.append((index, rewrite.result()))
        else:
            active[client.submit(prompt)] = (index, rewrite)

    while True:
        while len(active) < in_flight and (item := next(source, None)) is not None:
            advance(item[0], Rewrite(item[1]))
        yield from finished
        finished.clear()
        if not active:
            return
        for handle, reply in client.collect():
            index, rewrite = active.pop(handle)
            rewrite.answer(reply.text if reply else "")
            advance(index, rewrite)


def dropped_file(output: Path) -> Path:
    """Where the conversations that ended without an assistant turn are listed."""
    return output.with_name(output.name + ".dropped")


def source_file(output: Path) -> Path:
    """Where the data `output`'s indices count is recorded (`check_same_source`)."""
    return output.with_name(output.name + ".source")


def check_same_source(output: Path, data: Path, written: bool) -> None:
    """Records `data` (its size, and the SHA-256 of its first MiB) as `output`'s source, or, where `output` has
    `written` conversations of a recorded source, raises ValueError unless `data` is it: indices of one file skip
    another's conversations on a resume. An output written before sources were recorded takes `data` as its source;
    one with nothing written takes any."""
    with open(data, "rb") as f:
        identity = {"bytes": data.stat().st_size, "sha256_first_mib": hashlib.sha256(f.read(1 << 20)).hexdigest()}
    recorded = source_file(output)
    if not (written and recorded.exists()):
        recorded.write_text(json.dumps(identity) + "\n")
    elif (was := json.loads(recorded.read_text())) != identity:
        raise ValueError(f"{output} holds conversations of another data file ({was['bytes']:,} bytes; this one has "
                         f"{identity['bytes']:,}, or differs in its first MiB; {recorded} records it): give that "
                         "--data to resume, or another --output")


def written_indices(output: Path, repair: bool = False) -> set[int]:
    """The indices of the conversations already in `output` (or in its `dropped_file`, of the same layout). A last
    line cut by a kill does not count; with `repair` the file is truncated before it, so that appending continues it
    cleanly. A bad line before the last is an error (ValueError naming it): truncating there would drop the good
    records after it."""
    done, good = set(), 0  # `good`: bytes of whole lines
    if output.exists():
        data = output.read_bytes()
        lines = data.splitlines(keepends=True)
        for number, line in enumerate(lines, 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no line end")  # cut mid-write (even if the JSON is whole)
                done.add(json.loads(line)["index"])
            except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError; TypeError: not an object
                if number < len(lines):
                    raise ValueError(f"{output}, line {number}: not a regenerated conversation ({e!r}); "
                                     "fix or remove that line to resume") from e
                break
            good += len(line)
        if repair and good < len(data):
            with open(output, "r+b") as f:
                f.truncate(good)
    return done


Pending = list[tuple[tuple[int, str], Conversation]]  # ((index, place), conversation) still to regenerate


def pending(data: str | Path, output: Path, limit: int | None = None, shard: tuple[int, int] = (0, 1)
            ) -> tuple[Pending, int, int]:
    """The conversations of `data` (a file or packaged data set name) still to regenerate into `output` (indices in
    neither it nor its `dropped_file`, an interrupted last line cut off), of the first `limit`, and of `shard` (i, n):
    those whose index is i modulo n (one process per GPU); how many are done already; and how many `data` holds (of
    the first `limit`). Reads `data` whole (the reader parses the file at once anyway) after the output: a damaged
    output (ValueError: `written_indices`), a file the reader cannot read (ConversationError, OSError) and a `data`
    that is not the one `output` was regenerated from (ValueError: `check_same_source`) fail here, before any reply
    is asked for."""
    done = written_indices(output, repair=True) | written_indices(dropped_file(output), repair=True)
    path = resolve_asset(data)
    conversations = list(islice(read_placed_conversations(path), limit))
    check_same_source(output, path, written=bool(done))
    i_shard, n_shards = shard
    todo = [((i, place), c) for i, (place, c) in enumerate(conversations) if i % n_shards == i_shard and i not in done]
    return todo, len(done), len(conversations)


def regenerate_pending(todo: Pending, done: int, output: Path, client: Client, batch_size: int = 64) -> int:
    """Regenerates `todo` (`pending`'s) into `output` (JSONL, appended), `batch_size` conversations in flight, with a
    progress bar counting `done` earlier ones. Returns the number written."""
    written = 0
    with (open(output, "a") as f, open(dropped_file(output), "a") as f_dropped,
          tqdm(desc=f"regenerating ({done} done before)" if done else "regenerating", unit="conv",
               total=len(todo)) as bar):
        for (index, place), messages in regenerate(todo, client, batch_size):
            if any(m["role"] == "assistant" for m in messages):
                f.write(json.dumps({"index": index, "place": place, "messages": messages}) + "\n")
                f.flush()  # a whole line on disk per conversation: an interrupted run resumes from here
                written += 1
            else:  # not for training, but finished: a rerun does not ask again
                f_dropped.write(json.dumps({"index": index}) + "\n")
                f_dropped.flush()
            bar.update(1)
    return written


def regenerate_file(data: str | Path, output: Path, client: Client, batch_size: int = 64,
                    limit: int | None = None, shard: tuple[int, int] = (0, 1)) -> int:
    """Regenerates the conversations of `data` into `output` (`pending`: indices already there are skipped),
    `batch_size` conversations in flight. Returns the number written."""
    todo, done, _ = pending(data, output, limit, shard)
    return regenerate_pending(todo, done, output, client, batch_size)


def parse_shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.regenerate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--data", required=True,
                        help="conversation file (.gz, .bz2 or .xz too), or a packaged data set (sharegpt)")
    parser.add_argument("--output", type=Path, required=True, help="JSONL to write (resumed if it exists)")
    parser.add_argument("--target", help="HF directory, .gguf file or packaged model name (in-process)")
    parser.add_argument("--endpoint", help="an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="the model name sent to --endpoint (default: the first it lists)")
    parser.add_argument("--limit", type=int, help="regenerate only the first N conversations")
    parser.add_argument("--batch-size", type=int, default=64, help="conversations in flight at once")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="longest answer a turn, in tokens")
    add_sampling_arguments(parser)
    parser.add_argument("--max-prompt-tokens", type=int,
                        help="end a conversation before a turn whose prompt is longer (e.g. training's max_length; "
                        "in-process only)")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="take conversations I, I+N, I+2N, ... (e.g. 0/2 with --device cuda:0 and 1/2 with "
                        "--device cuda:1, each to its own --output)")
    add_engine_arguments(parser, draft=False)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    params = sampling_params(parser, args)
    if (args.target is None) == (args.endpoint is None):
        parser.error("give exactly one of --target (in-process) and --endpoint")
    given = given_flags(parser, argv)
    if args.endpoint:  # prompts are counted in the target's tokens; the engine is the server's
        refuse_unread(parser, given, ("max_prompt_tokens", "attention", "disable_cuda_graph", "disable_overlap",
                                      "device"), "--endpoint answers with a running server, whose settings are its own")
    else:
        refuse_unread(parser, given, ("model",), "--target answers in-process")
    require_positive(parser, args, "batch_size", "max_new_tokens", "max_prompt_tokens", "limit")
    require_output_dirs(parser, args, "output")
    if args.output.suffix.lower() in DECOMPRESSORS:  # readers would take its plain lines for a compressed stream
        parser.error(f"--output {args.output}: regeneration appends plain JSONL lines; name it .jsonl and compress it "
                     "when it is done (the readers take .gz, .bz2 and .xz files)")
    data = resolve_asset_argument(parser, "--data", args.data)  # before the target loads
    try:  # so are a file the reader cannot read (not UTF-8, a directory) and a damaged or another file's output
        todo, done, read = pending(data, args.output, args.limit, args.shard)
    except (ConversationError, OSError) as e:
        parser.error(f"--data: {e}")
    except ValueError as e:
        parser.error(f"--output: {e}")
    except KeyboardInterrupt:
        print("interrupted while reading --data: nothing written", file=sys.stderr)
        sys.exit(130)
    if not read:
        parser.error(f"--data {args.data}: no usable conversation (the reader's log names the records it skipped)")
    if not todo:  # a finished run, rerun: no model to load
        print(f"nothing to regenerate: every conversation asked for is in {args.output} or {dropped_file(args.output)}")
        return
    if args.endpoint:
        try:
            client = EndpointClient(args.endpoint, args.model, params, args.max_new_tokens)
        except EndpointError as e:  # unreachable: nothing has run
            parser.error(str(e))
    else:
        options = engine_options(parser, args)
        target, _, tokenizer, _ = load_models_for(parser, args.target, device=args.device)
        engine = Engine(target, None, EngineConfig(speculative=False, max_batch_size=args.batch_size, **options))
        client = EngineClient(engine, tokenizer, params, args.max_new_tokens, args.max_prompt_tokens)
    try:
        n = regenerate_pending(todo, done, args.output, client, args.batch_size)
    except EndpointError as e:  # failing mid-run: every finished conversation is written
        raise SystemExit(f"regenerate: error: {e}; rerun the same command to resume") from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGINT from `timeout -s INT`: every line written is whole and flushed
        print(f"interrupted: {len(written_indices(args.output))} conversations written to {args.output}; "
              "rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    print(f"wrote {n} conversations to {args.output}")


if __name__ == "__main__":
    main()
