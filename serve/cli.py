"""`serve-eagle`: an OpenAI-compatible server for a target and its EAGLE draft head (see api.py for the API).

    serve-eagle                                        # SmolLM2-135M-Instruct + runs/quickstart/final
    serve-eagle --speculative off                      # the same target, no head
    serve-eagle --target path/to/Llama-3.1-8B-Instruct --draft path/to/eagle3-head \\
        --num-steps 5 --topk 8 --num-draft-tokens 32 --host 0.0.0.0 --port 8000 --dtype bfloat16
    serve-eagle --target model.gguf --draft eagle-head --token-map freq_32768.pt   # with an FR-Spec map
    serve-eagle --recipe smollm2-135m --port 9000      # recipes/serve/smollm2-135m.yaml; flags override it

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import yaml

from eyas.common.assets import DEFAULT_TARGET
from eyas.common.cli import HelpFormatter

from .autotune import read_autotune
from .commands import (
    LOAD_ERRORS,
    TOKEN_MAP_HELP,
    add_device_argument,
    add_engine_arguments,
    add_tree_arguments,
    engine_options,
    frozen_heap,
    given_flags,
    load_models,
    memory_fraction,
    refuse_unread,
    require_positive,
    tree_shape,
)
from .draft import TreeShape
from .engine import Engine, EngineConfig
from .worker import EngineWorker

# Where `train-eagle --recipe quickstart --output runs/quickstart` writes its head (the trainer's `final/`
# directory): keep the two in step.
QUICKSTART_HEAD = Path("runs/quickstart/final")
QUICKSTART_COMMAND = "train-eagle --recipe quickstart --output runs/quickstart"
NO_QUICKSTART_HEAD = (f"no draft head at {QUICKSTART_HEAD}. Train the quickstart head first:\n"
                      f"    {QUICKSTART_COMMAND}\n"
                      "or give one with --draft DIR, or serve without a head: serve-eagle --speculative off")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SERVE_RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "serve"


def recipe_arguments(recipe: str, parser: argparse.ArgumentParser) -> list[str]:
    """A serving recipe (a path, or a name in recipes/serve/) as command-line flags: its keys are the flags'
    names with underscores (`num_steps: 5` is `--num-steps 5`, `disable_cuda_graph: true` is the bare switch,
    `speculative: off` is `--speculative off`); an unknown key is an error naming it."""
    path = Path(recipe) if Path(recipe).is_file() else SERVE_RECIPES / f"{recipe}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in SERVE_RECIPES.glob("*.yaml"))
        parser.error(f"--recipe {recipe!r}: no such file, nor a serving recipe (known: {known})")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        parser.error(f"{path}: not valid YAML: {e}")
    if not isinstance(values, dict):
        parser.error(f"{path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "recipe")}
    args = []
    for key, value in values.items():
        if key not in actions:
            parser.error(f"{path}: unknown key {key!r}; known keys: {sorted(actions)}")
        if value is None:
            parser.error(f"{path}: {key} has no value (leave the key out for the default)")
        action, flag = actions[key], actions[key].option_strings[-1]
        if action.nargs != 0 and not isinstance(value, bool):  # checked here, where the file and key can be named
            try:
                typed = action.type(str(value)) if action.type else str(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{path}: {key}: {value!r} is not a valid value ({e})")
            if action.choices and typed not in action.choices:
                parser.error(f"{path}: {key}: {value!r} is not one of {sorted(action.choices)}")
        if action.nargs == 0:  # a switch: given when true
            if not isinstance(value, bool):
                parser.error(f"{path}: {key} is true or false, got {value!r}")
            args += [flag] if value else []
        elif isinstance(value, bool) and action.choices and "on" in action.choices:  # YAML reads on/off as booleans
            args += [flag, "on" if value else "off"]
        else:
            args += [flag, str(value)]
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve-eagle", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"HF directory, .gguf file or packaged model name (default: {DEFAULT_TARGET})")
    parser.add_argument("--draft", type=Path,
                        help=f"draft head directory (EAGLE-3, EAGLE-1/2 or speculators); default with the default "
                             f"target: {QUICKSTART_HEAD}, written by `{QUICKSTART_COMMAND}`")
    parser.add_argument("--token-map", type=Path, help=TOKEN_MAP_HELP)
    parser.add_argument("--speculative", choices=["on", "off"], default="on",
                        help="off: serve the target alone, one token per step (no head needed)")
    add_tree_arguments(parser, TreeShape())
    parser.add_argument("--autotune", type=Path,
                        help="per-batch-size settings written by `bench-eagle --autotune FILE` (they replace the tree "
                             "flags): each decode step uses the setting measured fastest at its batch size")
    parser.add_argument("--model-name", help="the `model` clients send (default: the target's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 otherwise")
    add_engine_arguments(parser)
    parser.add_argument("--mem-fraction", type=memory_fraction, default=EngineConfig.mem_fraction,
                        help="share of the GPU memory left after loading that the KV cache takes")
    parser.add_argument("--max-batch-size", type=int, default=EngineConfig.max_batch_size,
                        help="requests decoded together at most; more wait in the queue")
    parser.add_argument("--recipe", help="a serving recipe (YAML of these flags; flags given here override it)")
    argv = sys.argv[1:] if argv is None else argv
    known, _ = parser.parse_known_args(argv)
    typed = given_flags(parser, argv)  # on the command line, not from the recipe
    if known.recipe:
        argv = recipe_arguments(known.recipe, parser) + argv
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:  # found out now, not after the model loads
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    require_positive(parser, args, "max_batch_size")
    args.tree = tree_shape(parser, args)
    try:
        args.tree_by_batch = read_autotune(args.autotune) if args.autotune else ()
        args.engine = EngineConfig(tree=args.tree, tree_by_batch=args.tree_by_batch, mem_fraction=args.mem_fraction,
                                   max_batch_size=args.max_batch_size, **engine_options(parser, args))
    except ValueError as e:
        parser.error(str(e))
    # Flags typed here that another setting would silently override (a recipe's are overridden by design).
    if args.speculative == "off":
        refuse_unread(parser, typed, ("draft", "token_map", "autotune", "num_steps", "topk", "num_draft_tokens",
                                      "draft_fp8"), "--speculative off serves the target alone")
    if args.autotune:
        refuse_unread(parser, typed, ("num_steps", "topk", "num_draft_tokens"),
                      "--autotune sets the tree per batch size")
    if args.speculative == "on" and args.draft is None:
        if args.target != DEFAULT_TARGET:
            parser.error("--draft is required with --target (or serve without a head: --speculative off)")
        args.draft = QUICKSTART_HEAD  # `main` says how to train it where it is not there yet
    return args


def model_name(spec: str, path: Path) -> str:
    """The name clients send: a packaged model's name as given, else the directory's name or the GGUF's stem."""
    if not Path(spec).expanduser().exists():
        return spec
    return path.stem if path.suffix == ".gguf" else path.resolve().name  # "." names the directory


def _usage_error(message: object) -> NoReturn:
    """Stops as argparse does on a usage error (the parser is `parse_args`'s): the message, exit status 2."""
    print(f"serve-eagle: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    from .api import GracefulServer, create_app

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The default head, or a recipe's (smollm2-135m's), before it was trained: the command that trains it.
    untrained = not (QUICKSTART_HEAD / "config.json").exists()
    if args.speculative == "on" and Path(args.draft) == QUICKSTART_HEAD and untrained:
        _usage_error(NO_QUICKSTART_HEAD)
    try:  # a missing or malformed model, or a tree this head or context cannot hold (a ConfigError)
        target, head, tokenizer, path = load_models(args.target, args.draft if args.speculative == "on" else None,
                                                    args.token_map, args.device, DTYPES.get(args.dtype))
        config = dataclasses.replace(args.engine, speculative=head is not None)
        engine = Engine(target, head, config)
    except LOAD_ERRORS as e:
        _usage_error(e)
    if engine.device.type == "cuda":  # elsewhere nothing is captured or compiled
        start = time.perf_counter()
        engine.warm_up(progress=True)
        print(f"[serve-eagle] warmed up (CUDA graphs and kernels for batch sizes up to {config.max_batch_size}) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    name = args.model_name or model_name(args.target, path)
    worker = EngineWorker(engine)
    app = create_app(worker, tokenizer, name)
    print(f"[serve-eagle] {name}" + (f" + {args.draft}" if head is not None else " (no speculation)")
          + f" on {args.device} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    # On Ctrl-C: new connections are refused, running requests get 30 s to finish (then they are aborted).
    try:
        with frozen_heap():
            GracefulServer(app, worker, host=args.host, port=args.port).run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it stopped for again once the server is down
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
