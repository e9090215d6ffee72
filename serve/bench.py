"""bench-eagle: speed of speculative decoding, every figure measured in one run.

    bench-eagle --target smollm2-135m-instruct --draft runs/quickstart/final --batch-sizes 1 8
    bench-eagle --random-weights --arch llama-3.1-8b --batch-sizes 1 --trees 7,1,8 5,4,8 6,8,48 --input-len 1024
    bench-eagle ... --autotune autotune.json        # the fastest setting per batch size, read by serve-eagle

For each batch size it runs speculation off and each tree setting (num_steps,topk,num_draft_tokens) over the same
prompts (`--num-prompts`, batch size at a time) and reports: τ (tokens per verification, bonus included), the mean
decode step split into draft / verify / accept (KV moves, draft extension, bookkeeping) and the host time a decode step
spends outside those three (scheduling, block tables, input copies), all timed one step at a time, and the time the
first batch's prompts took to prefill (at batch 1, one prompt: tokens/s pays it once a prompt); the decode step as
served ("served": that batch again, each step queued while the last runs, no syncs, the prefill left out), which the "x
off" column and the weight-streaming floor line compare; output tokens/s over the whole run (prefill included; after an
untimed run of the same work, which compiles the kernels), where steps overlap that host time unless
`--disable-overlap`; with `--repeats N` the median of N timed runs, taken in rounds across the batch size's settings,
and their spread; and the speedup over speculation off at the same batch size. With `--autotune` each batch size also
runs "off+head", speculation off as an autotuned serve-eagle runs it where its setting is off: the head loaded, extended
over the prompts at their prefill (decode steps leave it behind: `Engine._catch_up_drafts`). The autotune picks each
batch size's fastest of the trees and off+head (not the head-less "off", which such a server cannot run).
`--temperature` samples instead of decoding greedily (`--top-p`, `--top-k` filter it). `--compare-hf` times Hugging Face
`generate` on the batch-1 prompts. With random weights τ is meaningless (the draft guesses at random); step costs are
what such a run measures.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.common.architectures import ARCHITECTURES, random_target
from eyas.common.assets import asset_path
from eyas.common.cli import HelpFormatter
from eyas.common.config import TargetConfig
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.hot_vocab import HotVocab
from eyas.common.layers import Kernels, fuse_projections
from eyas.common.target import TargetModel, default_dtype
from eyas.data.conversations import read_conversations, read_json_lines
from eyas.data.tokenizer import render_chat

from .autotune import format_setting, parse_setting, write_autotune
from .commands import (
    TOKEN_MAP_HELP,
    add_device_argument,
    add_engine_arguments,
    add_sampling_arguments,
    engine_options,
    frozen_heap,
    given_flags,
    load_models_for,
    refuse_unread,
    require_output_dirs,
    require_positive,
    sampling_params,
    tree_setting,
)
from .cuda_graphs import replay_ms
from .draft import TreeShape
from .engine import Engine, EngineConfig, Request, blocks_to_admit, step_reserve
from .evaluate import load_questions
from .sampling import SamplingParams, for_prompt

OFF_WITH_HEAD = "off+head"  # the setting label of speculation off with the head kept current (`warm_engine`)


@dataclass
class Result:
    batch_size: int
    setting: str  # "off", OFF_WITH_HEAD or "steps,topk,tokens"
    tau: float
    step_ms: float  # a decode step's three phases, each timed between syncs (the split beside it)
    draft_ms: float
    verify_ms: float
    accept_ms: float
    host_ms: float  # a decode step's time outside the three phases: scheduling, block tables, input copies
    prefill_ms: float  # the first batch's prompts prefilled, whole (at batch 1: one prompt)
    tokens_per_s: float  # the median of `tokens_per_s_runs`
    peak_gib: float  # the weights and the most its own engine allocated, in its untimed run (0 on CPU)
    served_ms: float  # a decode step as served: steps overlapping the host's work, no syncs (`_served_step_ms`)
    speedup: float = 1.0
    step_vs_off: float = 1.0  # this setting's served step over the no-speculation one at the same batch size
    tokens_per_s_runs: list[float] = field(default_factory=list)  # each timed run's (`--repeats`)

    @property
    def spread(self) -> float:
        """The runs' range over their median: how far one run's figure can be trusted."""
        runs = self.tokens_per_s_runs
        return (max(runs) - min(runs)) / self.tokens_per_s if len(runs) > 1 else 0.0


EAGLE3_DRAFT_VOCAB = 32000  # the draft vocabulary of published EAGLE-3 heads (Llama-3.1-8B's)


def random_head_config(target: TargetConfig, draft_vocab: int | None = None) -> Eagle3Config:
    """The config of `random_head`'s head for a target of config `target`: one layer shaped like the target's, of
    `draft_vocab` draft tokens (None: EAGLE3_DRAFT_VOCAB; at most the target's)."""
    return Eagle3Config.for_target(target, min(draft_vocab or EAGLE3_DRAFT_VOCAB, target.vocab_size))


def random_head(target: TargetModel, draft_vocab: int | None = None) -> Eagle3Head:
    """A random head for `target` (`random_head_config`)."""
    cfg = random_head_config(target.config, draft_vocab)
    device, dtype = target.embed_tokens.weight.device, target.embed_tokens.weight.dtype
    with torch.device(device):
        head = Eagle3Head(cfg).to(dtype)
    head.set_hot_vocab(HotVocab(torch.arange(cfg.draft_vocab_size), cfg.vocab_size))
    head.rotary.reset_parameters(device)
    return head.eval()


def add_draft_vocab_argument(parser: argparse.ArgumentParser) -> None:
    """--draft-vocab: the random head's draft vocabulary (`random_head`)."""
    parser.add_argument("--draft-vocab", type=int, help=f"draft vocabulary of the random head (default "
                        f"{EAGLE3_DRAFT_VOCAB}, as EAGLE-3 heads; fewer: the draft passes' cost with a smaller hot "
                        "vocabulary, as FR-Spec's)")


PROMPT_SETS = ("sharegpt", "mt-bench", "humaneval")


def chat_prompts(name: str, tokenizer, n: int, max_len: int) -> list[list[int]]:
    """The first `n` first user turns of a packaged set that render to at most `max_len` tokens."""
    if name == "sharegpt":
        turns = (c[0]["content"] for c in read_conversations(asset_path(name)) if c[0]["role"] == "user")
    else:  # a benchmark's questions, as eval-eagle asks them
        turns = (question[0] for question in load_questions(name))
    rendered = (render_chat(tokenizer, [{"role": "user", "content": t}]) for t in turns)
    prompts = list(itertools.islice((ids for ids in rendered if len(ids) <= max_len), n))
    if not prompts:
        raise ValueError(f"no {name} prompt fits --input-len {max_len}")
    return (prompts * n)[:n]


def token_prompts(path: Path, vocab_size: int) -> list[list[int]]:
    """A JSONL of {"prompt_ids": [int, ...]} per line (ids in [0, vocab_size)) -> the prompts."""
    prompts = []
    for place, row in read_json_lines(path):
        ids = row.get("prompt_ids")
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)):
            raise ValueError(f"{path}, {place}: expected 'prompt_ids', a non-empty list of token ids in [0, "
                             f"{vocab_size})")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


GREEDY = SamplingParams(temperature=0)


def warm_engine(target, head, shape: TreeShape | None, prompts, max_new_tokens, batch_size,
                params: SamplingParams | list[SamplingParams] = GREEDY, head_kept: bool = False, **options) -> Engine:
    """An engine for one setting (speculation off when `shape` is None; with `head_kept` the head is still loaded
    and extended over the prompts, as an autotuned server runs a batch size whose setting is off) with KV room
    for `batch_size` of `prompts` and `max_new_tokens` each, admitted together (`blocks_to_admit`: else a batch
    would run a request short), after an untimed run of that work (`generate_all`).
    Triton compiles a kernel variant the first time a shape class appears (prompt lengths, batch buckets, acceptance
    lengths) and each bucket's CUDA graphs are captured on first use: seconds that a serving process pays once, and
    a timed first run would charge to one setting."""
    block_size = 16
    longest = max(len(p) for p in prompts) + max_new_tokens + step_reserve([shape] if shape else [])
    speculative = shape is not None or head_kept
    config = EngineConfig(speculative=speculative, tree=shape or TreeShape(), max_batch_size=batch_size,
                          tree_by_batch=((batch_size, None),) if head_kept else (), block_size=block_size,
                          num_blocks=blocks_to_admit(-(-longest // block_size), batch_size), **options)
    engine = Engine(target, head if speculative else None, config)
    generate_all(engine, prompts, max_new_tokens, batch_size, params)
    return engine


def batch_prompt_count(batch_size: int, num_prompts: int) -> int:
    """The prompts a batch size runs: `num_prompts`, rounded up to whole batches (a last, smaller batch would count
    a smaller batch's steps in this one's figures)."""
    return batch_size * -(-num_prompts // batch_size)


def generate_all(engine: Engine, prompts, max_new_tokens, batch_size,
                 params: SamplingParams | list[SamplingParams] = GREEDY) -> list[Request]:
    """Generation for every prompt, `batch_size` at a time (`params`: the run's, or each prompt's: `each_prompt`)."""
    params = each_prompt(params, prompts)
    return [r for i in range(0, len(prompts), batch_size)
            for r in engine.generate(prompts[i:i + batch_size], params[i:i + batch_size], max_new_tokens)]


def each_prompt(params: SamplingParams | list[SamplingParams], prompts: list[list[int]]) -> list[SamplingParams]:
    """The run's `params` for each prompt: a seeded run's with the prompt's own seed (`sampling.for_prompt`); a list
    (each prompt's already) as it is. `run_settings` makes it once, so that no timed run hashes the prompts."""
    return params if isinstance(params, list) else [for_prompt(params, p) for p in prompts]


def run_settings(target, head, settings: list[tuple[TreeShape | None, bool]], prompts, max_new_tokens, batch_size,
                 params: SamplingParams = GREEDY, repeats: int = 1, **options) -> list[Result]:
    """Each setting (a tree, or None for speculation off; and whether the head is kept, `warm_engine`) generates for
    every prompt, `batch_size` at a time, `repeats` timed times after the same untimed run: tokens/s (prefill
    included; the median run's, so that one run's hiccup does not decide a comparison) and τ, unsynchronised; then
    the step split from the first batch run again with each phase timed. With `repeats` above 1 every setting's engine
    is built first and the timed runs go round by round, each round timing every setting once, so that a drift over
    the sweep (the GPU's clocks, the host's load: the 8B's step without speculation fell 4.72 -> 4.37 ms over four
    processes of one call, docs/perf.md's twenty-fifth entry) falls on all of them alike and not on the later ones;
    one setting at a time otherwise, the least memory. `options`: further EngineConfig fields. -> a Result a setting,
    in order."""
    groups = [settings] if repeats > 1 else [[setting] for setting in settings]
    params = each_prompt(params, prompts)
    return [result for group in groups for result in _run_group(target, head, group, prompts, max_new_tokens,
                                                                  batch_size, params, repeats, **options)]


def _run_group(target, head, group, prompts, max_new_tokens, batch_size, params, repeats, **options) -> list[Result]:
    """`run_settings` for settings whose engines are held at once; they are freed on return, before the next group
    reads its weights' memory."""
    device = target.lm_head_weight.device
    gc.collect()  # the last group's engines (their graphs hold cycles), before `weights` is read
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # and what else no engine holds
    engines, peaks = [], []  # a setting's peak GiB: the weights and its own engine's most, not the others'
    for shape, head_kept in group:
        engine, added = _warmed(target, head, shape, prompts, max_new_tokens, batch_size, params, head_kept, **options)
        engines.append(engine)
        peaks.append((weights + added) / 2**30)
    runs = [[] for _ in group]  # (tokens/s, tokens generated after the prefill, verifications) a timed run
    with frozen_heap():
        for _ in range(repeats):
            for engine, timed in zip(engines, runs, strict=True):
                timed.append(_timed_run(engine, prompts, max_new_tokens, batch_size, params))
        return [_result(engine, shape, head_kept, timed, peak, prompts[:batch_size], max_new_tokens,
                        params[:batch_size])
                for (shape, head_kept), engine, peak, timed in zip(group, engines, peaks, runs, strict=True)]


def _result(engine: Engine, shape: TreeShape | None, head_kept: bool, timed: list[tuple[float, int, int]],
            peak_gib: float, batch: list[list[int]], max_new_tokens: int, params: list[SamplingParams]) -> Result:
    """A setting's Result from its timed runs (`_timed_run`'s) and a run of `batch` (each prompt with its `params`)
    with each phase timed."""
    generated, verifications = sum(run[1] for run in timed), sum(run[2] for run in timed)
    tau = generated / max(verifications, 1) if shape else 1.0  # none when every request stops at its prefill
    served_ms = _served_step_ms(engine, batch, max_new_tokens, params)
    engine.profile, engine.decode_steps = True, 0
    engine.generate(batch, params, max_new_tokens)
    t, steps = engine.timings, max(engine.decode_steps, 1)
    speeds = [run[0] for run in timed]
    return Result(
        len(batch), OFF_WITH_HEAD if head_kept else format_setting(shape), tau,
        1e3 * (t["draft"] + t["verify"] + t["accept"]) / steps,
        1e3 * t["draft"] / steps, 1e3 * t["verify"] / steps, 1e3 * t["accept"] / steps,
        1e3 * (t["decode"] - t["draft"] - t["verify"] - t["accept"]) / steps, 1e3 * t["prefill"],
        statistics.median(speeds), peak_gib, served_ms, tokens_per_s_runs=speeds,
    )


def _served_step_ms(engine: Engine, batch: list[list[int]], max_new_tokens: int, params: list[SamplingParams]
                    ) -> float:
    """`batch` generated as a server runs it, each decode step queued while the last one runs, timed from the end
    of its prefills (one sync there, one at the end) -> ms a decode step. The phase split's syncs stop the host's
    work from overlapping the device's; this is the step that tokens/s pays, without the prefill."""
    requests = [engine.add_request(p, q, max_new_tokens) for p, q in zip(batch, params, strict=True)]
    while not all(r.output for r in requests):  # prefill steps come before any decode step
        engine.step()
    _sync(engine.device)
    start, engine.decode_steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
    _sync(engine.device)
    return 1e3 * (time.perf_counter() - start) / max(engine.decode_steps, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warmed(target, head, shape, prompts, max_new_tokens, batch_size, params, head_kept, **options
            ) -> tuple[Engine, int]:
    """`warm_engine`, and the most GPU memory its untimed run added, in bytes (0 on CPU): that run does the timed
    runs' work and captures their graphs."""
    device = target.lm_head_weight.device
    if device.type != "cuda":
        return warm_engine(target, head, shape, prompts, max_new_tokens, batch_size, params, head_kept, **options), 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine = warm_engine(target, head, shape, prompts, max_new_tokens, batch_size, params, head_kept, **options)
    torch.cuda.synchronize(device)
    return engine, torch.cuda.max_memory_allocated(device) - before


def _timed_run(engine: Engine, prompts, max_new_tokens, batch_size, params) -> tuple[float, int, int]:
    """One timed generation of every prompt -> (output tokens/s, tokens generated after the prefills, verifications)."""
    start = time.perf_counter()
    requests = generate_all(engine, prompts, max_new_tokens, batch_size, params)
    _sync(engine.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output) for r in requests)
    return tokens / seconds, tokens - len(requests), sum(len(r.accepted) for r in requests)


@torch.no_grad()
def weight_streaming_floor_ms(target: TargetModel, linear=torch.nn.functional.linear) -> float:
    """Time of one token through the model's linear layers alone (every weight read once, nothing else),
    as a CUDA-graph replay: the floor a batch-1 decode step can approach. The layers as the engine serves
    them: q/k/v and gate/up joined (`fuse_projections`), each through `linear` (cuBLAS, or the served model's
    one-token kernel); the lm_head through cuBLAS, as `TargetModel.logits` runs it."""
    fuse_projections(target)
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]  # the decoder stack
    head = target.lm_head_weight
    x = {m.in_features: torch.randn(1, m.in_features, device=head.device, dtype=head.dtype) for m in linears}
    x.setdefault(head.shape[1], torch.randn(1, head.shape[1], device=head.device, dtype=head.dtype))

    def run():
        for m in linears:
            linear(x[m.in_features], m.weight)
        x[head.shape[1]] @ head.T

    return replay_ms(run)


def hf_tokens_per_s(target_path: Path, prompts, max_new_tokens, device, dtype) -> float:
    """Hugging Face `generate` (greedy, batch 1) on the same prompts, output tokens/s."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": target_path.name} if target_path.suffix == ".gguf" else {}
    folder = target_path.parent if target_path.suffix == ".gguf" else target_path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device).eval()
    total, seconds = 0, 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
        if device != "cpu":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        total += out.shape[1] - ids.shape[1]
    return total / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench-eagle", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--target", help="HF directory, .gguf file or packaged model name")
    parser.add_argument("--draft", help="a draft head directory")
    parser.add_argument("--token-map", help=TOKEN_MAP_HELP)
    parser.add_argument("--random-weights", action="store_true",
                        help="random target and head of --arch, instead of --target and --draft")
    parser.add_argument("--arch", default="llama-3.1-8b", choices=sorted(ARCHITECTURES),
                        help="--random-weights' architecture (the 8B's needs a GPU: 16 GB in bf16)")
    add_draft_vocab_argument(parser)
    parser.add_argument("--prompts", help="sharegpt, mt-bench or humaneval (their first user turns in the target's "
                        "chat template, at most --input-len tokens), or a JSONL of {'prompt_ids': [...]} (default: "
                        "random tokens of --input-len)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (random prompts), or the most of one")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens a prompt (at least 2: the first "
                        "comes from the prefill, the decode steps after it are what is timed)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="requests decoded together, each timed")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of each setting, in rounds that time every setting of a batch size once "
                        "(their engines held at once); tokens/s is the median run's and the table's spread column "
                        "their range over it (3 or more where settings are close, as at large batch sizes, whose runs "
                        "are short)")
    parser.add_argument("--num-prompts", type=int, default=1,
                        help="prompts per batch size, that batch size at a time (never fewer than the batch size; "
                        "Hugging Face runs this many at batch 1)")
    parser.add_argument("--trees", type=tree_setting, nargs="+",
                        default=[TreeShape(7, 1, 8), TreeShape(5, 4, 8), TreeShape(6, 8, 48)],
                        help="num_steps,topk,num_draft_tokens settings (default: 7,1,8 5,4,8 6,8,48)")
    add_sampling_arguments(parser)  # above 0 without --seed each request draws a seed: τ varies from run to run
    parser.add_argument("--compare-hf", action="store_true", help="also time Hugging Face generate (batch 1)")
    parser.add_argument("--autotune", type=Path, help="write the fastest setting per batch size to this JSON")
    parser.add_argument("--json", type=Path, help="write every result to this JSON")
    add_engine_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    dtype = default_dtype(args.device)
    if args.output_len < 2:
        parser.error(f"--output-len must be at least 2, got {args.output_len}")
    if None in args.trees:
        parser.error("--trees: off is always measured (each batch size's first row); list trees only")
    require_positive(parser, args, "input_len", "num_prompts", "batch_sizes", "repeats", "draft_vocab")
    require_output_dirs(parser, args, "json", "autotune")
    params = sampling_params(parser, args)
    if args.compare_hf and not params.greedy:
        parser.error("--compare-hf times Hugging Face's greedy generate: leave --temperature at 0")
    given = given_flags(parser, argv)
    if args.prompts and args.prompts not in PROMPT_SETS:
        refuse_unread(parser, given, ("input_len",), "a --prompts file's prompt_ids are the prompts, whole")
    if not args.random_weights:
        refuse_unread(parser, given, ("arch",), "--arch names the random model of --random-weights")
    if args.random_weights:  # before building a model
        if args.prompts in PROMPT_SETS:
            parser.error(f"--prompts {args.prompts} renders chat prompts with a real --target's tokenizer")
        refuse_unread(parser, given, ("target", "draft", "token_map", "compare_hf"),
                      "--random-weights measures a random model of --arch")

    options = engine_options(parser, args)
    if args.random_weights:
        target = random_target(args.arch, dtype, args.device)
        head = random_head(target, args.draft_vocab)
    else:
        if args.draft_vocab:
            parser.error("--draft-vocab sizes the random head of --random-weights; a trained head has its own")
        if not (args.target and args.draft):
            parser.error("give --target and --draft, or --random-weights")
        target, head, tokenizer, path = load_models_for(parser, args.target, args.draft, args.token_map, args.device,
                                                        dtype)
    n = max(batch_prompt_count(bs, args.num_prompts) for bs in args.batch_sizes)
    try:
        if args.prompts in PROMPT_SETS:
            prompts = chat_prompts(args.prompts, tokenizer, n, args.input_len)
        elif args.prompts:
            prompts = (token_prompts(Path(args.prompts), target.config.vocab_size) * n)[:n]
        else:
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(0, target.config.vocab_size, (n, args.input_len), generator=g).tolist()
    except (OSError, ValueError) as e:
        parser.error(f"--prompts: {e}")
    context, reserve = target.config.max_position_embeddings, step_reserve(args.trees)
    if (longest := max(map(len, prompts))) + args.output_len + reserve - 1 > context:  # else outputs would be cut
        parser.error(f"prompts of up to {longest} tokens, --output-len {args.output_len} and the trees' "
                     f"{reserve - 1} positions of a step's drafts pass the target's context of {context} tokens")
    for shape in args.trees:  # before the sweep, not when its engine is built
        if shape.topk > head.draft_vocab_size:
            parser.error(f"--trees {format_setting(shape)}: topk {shape.topk} is more than the head's draft "
                         f"vocabulary of {head.draft_vocab_size} tokens")

    settings = [(None, False)] + [(shape, False) for shape in args.trees] + ([(None, True)] if args.autotune else [])
    results: list[Result] = []
    for bs in args.batch_sizes:
        batch_prompts = prompts[:batch_prompt_count(bs, args.num_prompts)]
        base, *others = run_settings(target, head, settings, batch_prompts, args.output_len, bs, params,
                                     repeats=args.repeats, **options)
        results.append(base)
        for r in others:
            r.speedup = r.tokens_per_s / base.tokens_per_s
            r.step_vs_off = r.served_ms / base.served_ms
            results.append(r)
            print(f"  batch {bs} {r.setting}: {r.tokens_per_s:.1f} tok/s", file=sys.stderr)
        if args.json:  # after each batch size: a sweep stopped later (time limit, crash) keeps what it measured
            args.json.write_text(json.dumps([{**r.__dict__, "spread": r.spread} for r in results], indent=2))

    print(f"{'batch':>5} {'setting':>9} {'tau':>5} {'step ms':>8} {'draft':>7} {'verify':>7} {'accept':>7} "
          f"{'host':>6} {'prefill':>7} {'served':>7} {'x off':>6} {'tok/s':>8} {'spread':>6} {'speedup':>7} "
          f"{'peak GiB':>8}")
    for r in results:
        print(f"{r.batch_size:>5} {r.setting:>9} {r.tau:>5.2f} {r.step_ms:>8.2f} {r.draft_ms:>7.2f} "
              f"{r.verify_ms:>7.2f} {r.accept_ms:>7.2f} {r.host_ms:>6.2f} {r.prefill_ms:>7.2f} {r.served_ms:>7.2f} "
              f"{r.step_vs_off:>6.2f} {r.tokens_per_s:>8.1f} "
              f"{f'{r.spread:.1%}' if len(r.tokens_per_s_runs) > 1 else '-':>6} {r.speedup:>7.2f} {r.peak_gib:>8.1f}")
    if args.device.startswith("cuda"):
        served = target.model.layers[0].mlp.kernels.linear
        floors = {"cuBLAS": weight_streaming_floor_ms(target)}
        if served is not Kernels.linear:
            floors["served kernel"] = weight_streaming_floor_ms(target, served)
        floor = min(floors.values())  # the stricter
        off = next(r for r in results if r.batch_size == 1 and r.setting == "off") if 1 in args.batch_sizes else None
        ratio = (f"; speculation off at batch 1, a step as served: {off.served_ms:.2f} ms ({off.served_ms / floor:.2f}x"
                 f"; timed between syncs {off.step_ms:.2f} ms, {off.step_ms / floor:.2f}x)" if off else "")
        each = ", ".join(f"{name} {ms:.2f} ms" for name, ms in floors.items())
        print(f"weight-streaming floor (linear layers alone, CUDA graph; {each}): {floor:.2f} ms{ratio}")
    if args.autotune:  # what the server can run: the trees, and off with the head kept
        fastest = {bs: max((r for r in results if r.batch_size == bs and r.setting != "off"),
                           key=lambda r: r.tokens_per_s) for bs in args.batch_sizes}
        write_autotune(args.autotune, {bs: None if r.setting == OFF_WITH_HEAD else parse_setting(r.setting)
                                       for bs, r in fastest.items()})
    if args.compare_hf:
        hf = hf_tokens_per_s(path, prompts[:args.num_prompts], args.output_len, args.device, dtype)
        best = max((r.tokens_per_s for r in results if r.batch_size == 1), default=None)
        vs = f"; eyas best at batch 1 on the same prompts: {best:.1f} tok/s ({best / hf:.2f}x)" if best else ""
        print(f"Hugging Face generate, batch 1: {hf:.1f} tok/s{vs}")


if __name__ == "__main__":
    main()
