"""Chat with a target through eyas's own model code (target-only greedy decoding over the paged KV cache).

    python -m eyas.serve.chat "What is speculative decoding?"          # the embedded SmolLM2-135M-Instruct
    python -m eyas.serve.chat --target path/to/hf_dir_or.gguf "Hello"
"""

from __future__ import annotations

import argparse
import sys
import time

from eyas.common.assets import DEFAULT_TARGET
from eyas.common.cli import HelpFormatter
from eyas.data.tokenizer import render_chat, stop_token_ids

from .commands import add_device_argument, load_models_for, require_positive
from .generate import greedy_tokens
from .text import TextStream


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.chat", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"HF directory, .gguf file or packaged model name (default: {DEFAULT_TARGET})")
    parser.add_argument("--system", help="an optional system message")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    require_positive(parser, args, "max_new_tokens")

    started = time.perf_counter()
    model, _, tokenizer, path = load_models_for(parser, args.target, device=args.device)
    print(f"[loaded {path.name} in {time.perf_counter() - started:.1f}s on {args.device}]", file=sys.stderr)

    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    prompt = render_chat(tokenizer, messages)
    if len(prompt) > model.config.max_position_embeddings:
        parser.error(f"the prompt has {len(prompt)} tokens; {path.name}'s context holds "
                     f"{model.config.max_position_embeddings}")
    stops = stop_token_ids(tokenizer)
    text, count = TextStream(tokenizer, prompt=prompt), 0
    started = time.perf_counter()
    for token in greedy_tokens(model, prompt, args.max_new_tokens, stop_ids=stops):
        if token in stops:
            break
        count += 1
        print(text.push([token]), end="", flush=True)
    seconds = time.perf_counter() - started
    print(text.finish())
    print(f"[{count} tokens in {seconds:.1f}s, {count / seconds:.1f} tokens/s]", file=sys.stderr)


if __name__ == "__main__":
    main()
