"""What the command-line tools (serve-eagle, eval-eagle, bench-eagle, regenerate, chat) share: the engine, tree and
sampling flags, and loading a target with its tokenizer and draft head.

    add_tree_arguments(parser, TreeShape(7, 1, 8))      # --num-steps, --topk, --num-draft-tokens
    tree = tree_shape(parser, parser.parse_args())      # an impossible tree is a usage error
    add_sampling_arguments(parser)                      # --temperature, --top-p, --top-k, --seed
    params = sampling_params(parser, args)              # a bad value is a usage error naming its flag
    parser.add_argument("--trees", type=tree_setting, nargs="+")   # settings such as 7,1,8 or off
    target, head, tokenizer, path = load_models("smollm2-135m-instruct", "runs/quickstart/final", device="cuda")
    with frozen_heap(): ...                             # serve or time without the GC's full collections' stalls
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from eyas.common.assets import resolve_target
from eyas.common.checkpoint import CheckpointError, gguf_parsed_once
from eyas.common.config import ConfigError
from eyas.common.head_checkpoint import DraftHead, head_config_path, load_draft_head
from eyas.common.hot_vocab import HotVocabError
from eyas.common.target import TargetModel, default_dtype
from eyas.data.tokenizer import load_tokenizer

from .attention import BACKENDS, attention_backend
from .autotune import parse_setting
from .draft import TreeShape
from .sampling import SamplingParams


def engine_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The EngineConfig fields `add_engine_arguments`' options set. An --attention backend that --device cannot run
    (triton or flashinfer on a CPU, flashinfer not installed) is a usage error: read them before any model loads."""
    try:
        attention_backend(args.attention, torch.device(args.device))
    except ConfigError as e:
        parser.error(f"--attention {args.attention}: {e}")
    return {"attention": args.attention, "cuda_graphs": not args.disable_cuda_graph,
            "overlap": not args.disable_overlap, "draft_fp8": args.draft_fp8}


def add_engine_arguments(parser, draft: bool = True) -> None:
    """The engine options every serving command shares: `--attention`, `--disable-cuda-graph`, `--disable-overlap`
    and (`draft`: for a command that loads a head) `--draft-fp8`."""
    parser.add_argument("--attention", choices=BACKENDS, default="auto",
                        help="attention backend: triton (paged kernels, CUDA graphs), flashinfer (needs "
                             "flashinfer-python; no CUDA graphs), torch (reference), or auto: triton on CUDA when "
                             "installed (default)")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="run decode steps eagerly (CUDA graphs are on by default with the triton backend)")
    parser.add_argument("--disable-overlap", action="store_true",
                        help="run decode steps one at a time: by default a step is queued before the last one's "
                             "tokens reach the host, so the host's work between steps overlaps the GPU's")
    if not draft:
        parser.set_defaults(draft_fp8=False)
        return
    parser.add_argument("--draft-fp8", action="store_true",
                        help="round the draft head's linear weights to float8 (a power-of-two scale per row): on "
                             "CUDA its passes of up to 16 rows (a chain's or a tree's at batch 1) then read half the "
                             "bytes of its large weights. The served tokens are still the target's; the acceptance "
                             "may change (measure it with eval-eagle)")


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the flags in `argv` (abbreviated ones too), as argparse reads them: parsed with every
    default suppressed, so a flag given its default value still counts."""
    defaults = {action: action.default for action in parser._actions}
    for action in defaults:
        action.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_known_args(argv)[0]))
    finally:
        for action, default in defaults.items():
            action.default = default


def refuse_unread(parser: argparse.ArgumentParser, given: set[str], unread: tuple[str, ...], why: str) -> None:
    """A usage error if any flag of `unread` (destinations) was given (`given_flags`): a flag the chosen mode would
    silently ignore."""
    if ignored := [dest for dest in unread if dest in given]:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in ignored)
        parser.error(f"{why}: {flags} would be ignored")


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *dests: str) -> None:
    """A usage error naming the first flag of `dests` (destinations) whose value, or a list's least value, is below 1;
    a flag not given (None) passes."""
    for dest in dests:
        value = getattr(args, dest)
        least = min(value) if isinstance(value, list) else value
        if least is not None and least < 1:
            parser.error(f"--{dest.replace('_', '-')} must be at least 1, got {least}")


def require_output_dirs(parser: argparse.ArgumentParser, args: argparse.Namespace, *dests: str) -> None:
    """A usage error for a file flag of `dests` (given) that names a directory or whose folder does not exist: found
    out before the work whose results it would hold, not after it."""
    for dest in dests:
        if (path := getattr(args, dest)) is None:
            continue
        if Path(path).is_dir():
            parser.error(f"--{dest.replace('_', '-')} {path}: a directory; give the file's name")
        if not Path(path).parent.is_dir():
            parser.error(f"--{dest.replace('_', '-')} {path}: no directory {Path(path).parent}")


def add_tree_arguments(parser: argparse.ArgumentParser, default: TreeShape) -> None:
    """--num-steps, --topk and --num-draft-tokens, defaulting to `default`; read them with `tree_shape`."""
    parser.add_argument("--num-steps", type=int, default=default.num_steps, help="draft tree depth")
    parser.add_argument("--topk", type=int, default=default.topk, help="draft tree branching")
    parser.add_argument("--num-draft-tokens", type=int, default=default.num_draft_tokens,
                        help="tree nodes verified per step, root included")


def tree_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TreeShape:
    """The tree of `add_tree_arguments`' flags; one TreeShape rejects (e.g. more draft tokens than the tree
    holds) is a usage error naming the flags, not a traceback."""
    try:
        return TreeShape(args.num_steps, args.topk, args.num_draft_tokens)
    except ValueError as e:
        parser.error(f"invalid tree (--num-steps {args.num_steps} --topk {args.topk} "
                     f"--num-draft-tokens {args.num_draft_tokens}): {e}")


def add_sampling_arguments(parser: argparse.ArgumentParser, top_k: bool = True) -> None:
    """--temperature, --top-p, (with `top_k`) --top-k and --seed of every request; read them with `sampling_params`
    (whose seed is the run's: each prompt's comes from it and the prompt, `sampling.for_prompt`). A tool with the
    tree's --topk leaves --top-k out: one letter apart, each would be taken for the other."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus mass every sampled request keeps (default 1: off; needs --temperature)")
    if top_k:
        parser.add_argument("--top-k", type=int, default=0,
                            help="most likely tokens every sampled request keeps (default 0: off; needs --temperature)")
    else:
        parser.set_defaults(top_k=0)
    parser.add_argument("--seed", type=int, help="seed of a sampled run: each prompt draws with a seed made from this "
                        "one and the prompt, so that a rerun, or the run with speculation on or off, draws the same "
                        "numbers (the text is the same up to rounding: in bf16 on a GPU speculation's answers part "
                        "from the baseline's within tens of tokens at temperature 1); default: a fresh seed each "
                        "request, each run samples anew")


def sampling_params(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of `add_sampling_arguments`' flags. A value SamplingParams rejects, or a filter or seed
    without a temperature (greedy decoding would ignore it), is a usage error naming the flag."""
    for flag, value in (("--temperature", dict(temperature=args.temperature)), ("--top-p", dict(top_p=args.top_p)),
                        ("--top-k", dict(top_k=args.top_k)), ("--seed", dict(seed=args.seed))):
        try:
            SamplingParams(**value)
        except ValueError as e:
            parser.error(f"{flag}: {e}")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if params.greedy and (params.top_p < 1 or params.top_k > 0):
        filters = "--top-p and --top-k filter" if "--top-k" in parser._option_string_actions else "--top-p filters"
        parser.error(f"{filters} sampled tokens: set --temperature above 0 (0 decodes greedily)")
    if params.greedy and params.seed is not None:
        parser.error("--seed seeds sampled tokens: set --temperature above 0 (0 decodes greedily, drawing nothing)")
    return params


def tree_setting(text: str) -> TreeShape | None:
    """argparse type of a setting in autotune's format ("off" or "num_steps,topk,num_draft_tokens"): a malformed
    or impossible one is a usage error naming the flag and the reason, not a traceback."""
    try:
        return parse_setting(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message; a ValueError only as "invalid"
        raise argparse.ArgumentTypeError(str(e)) from e


TOKEN_MAP_HELP = ("an FR-Spec token map (freq_N.pt: token ids, most frequent first, as `python -m eyas.data.vocab` "
                  "writes): an EAGLE-1/2 head drafts from those rows of the target's lm_head; an EAGLE-3 head keeps "
                  "the tokens of its own draft vocabulary that the map names, so each draft pass reads and ranks "
                  "fewer lm_head rows")


class Models(NamedTuple):
    target: TargetModel
    head: DraftHead | None
    tokenizer: PreTrainedTokenizerBase
    path: Path  # the target's directory or .gguf file


# What `load_models` raises for a missing or malformed target, tokenizer, head or token map (a config field, a tensor,
# a head for another target), each naming the culprit, and `Engine` for settings its models cannot hold (ConfigError):
# a command's usage error. Other errors keep their traceback: a ValueError from a bug is not the user's input.
LOAD_ERRORS = (FileNotFoundError, ConfigError, CheckpointError, HotVocabError)


def load_models_for(parser: argparse.ArgumentParser, *args, **kwargs) -> Models:
    """`load_models` for a command line: its input errors (LOAD_ERRORS) are usage errors."""
    try:
        return load_models(*args, **kwargs)
    except LOAD_ERRORS as e:
        parser.error(str(e))


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the models run: cuda, cuda:N or cpu (default: cuda where there is a GPU)")


def memory_fraction(text: str) -> float:
    """--mem-fraction, checked as it is parsed (before any model loads): a share of GPU memory, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _device(text: str) -> str:
    """--device, checked as it is parsed (before any model loads): a device torch names, a GPU that is there."""
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N") from e
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: eyas runs on cpu or cuda")
    return text


def load_models(target: str | Path, draft: str | Path | None = None, token_map: str | Path | None = None,
                device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Models:
    """The target (a path or packaged model name), its tokenizer and, when `draft` is given, the draft head,
    restricted by `token_map` (an FR-Spec freq_N.pt: `TOKEN_MAP_HELP`). `dtype` None: bf16 on CUDA, fp32
    elsewhere. A missing target, head or token map raises FileNotFoundError naming it."""
    if draft is not None:  # before the target is fetched or loaded (many GB): a wrong --draft fails at once
        head_config_path(draft)
    path = resolve_target(target)
    dtype = dtype or default_dtype(device)
    with gguf_parsed_once():  # a GGUF target's tokenizer from the reader its weights came from
        model = TargetModel.from_pretrained(path, dtype=dtype, device=device)
        tokenizer = load_tokenizer(path)
    head = None if draft is None else load_draft_head(draft, model, token_map=token_map, dtype=dtype, device=device)
    return Models(model, head, tokenizer, path)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While serving or timing runs, the objects alive at its start (torch's, Triton's, the models' and their CUDA
    graphs') are left out of the garbage collector's full collections. Each would scan them all and stall the engine's
    thread, and with it every running request: a SmolLM2 engine warmed up on an H100, 440,000 objects, 0.24-0.25 s a
    collection, 0.0 ms with them frozen (the tiny test models on a CPU: 338,000, 0.20-0.23 s and 0.2 ms; docs/perf.md,
    sixty-third entry). They are collectable again afterwards: engines built and dropped in turn (bench-eagle's
    settings) are freed, and Triton's objects before its bindings check for leaks at exit."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
