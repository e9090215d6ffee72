"""Kernels per decode-step phase: where a batch-1 step's launches go, setting by setting.

    python -m eyas.serve.profile --arch smollm2-135m --trees off 6,8,48
    python -m eyas.serve.profile --arch llama-3.1-8b --trees 5,4,8 --temperature 0.8 --top-p 0.9   # sampled
    python -m eyas.serve.profile --arch smollm2-135m --trees off 5,4,8 --idle   # the GPU's idle time a step
    python -m eyas.serve.profile --arch llama-3.1-8b --trees 5,4,8 --draft-fp8   # the engine as bench-eagle runs it

A small model's step is bound by how many kernels it launches, not by bytes, and only the launches of the draft, the
accept phase and verification's extra over a plain pass set the speedup of speculation. For each setting this runs
an engine on random weights of --arch (a step's kernels do not depend on the weights) at batch 1, a prompt of
--input-len random tokens, and profiles --new-tokens of decoding with `torch.profiler` (after an untimed run of the
same generation, which captures the CUDA graphs and compiles the kernels), greedy unless --temperature. The engine
times its phases between syncs, so each phase's device work lies inside its span (`Engine._phase`). Per phase it
prints the kernels a step and the most charged kernels: counts are exact; times carry the profiler's overhead
(bench-eagle measures step times). On Hopper a Triton kernel's own time also holds its wait on the kernel before
(programmatic dependent launch starts it early: `eyas.serve.kernels.launch_options`), so each kernel is also
charged only what it adds to the end of the work before it: the charges of a phase add up to its busy time, as the
own times do not (`--arch llama-3.1-8b --trees 6,8,48 --draft-fp8` on an H100: verification's 128 few-rows linears
ran 8.39 ms a step and were charged 5.38; docs/perf.md, fifty-second entry). Off CUDA it counts the torch operators
each phase calls instead.

With --idle (CUDA only) the steps run as they do in serving instead, the next one queued while the last runs, and
the profile reports how long the GPU idles a step between kernels, and around which kernels: the host's share of a
step that the overlap does not hide. The profiler's own work per launch adds to the host's: a small model's profiled
steps are host-bound where its served ones are not (SmolLM2, plain: 1.05 ms a step profiled, 0.60–0.63 ms served;
docs/perf.md), so there the idle time is the profiled host's. A large model's should be near none.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from eyas.common.architectures import ARCHITECTURES, architecture_config, random_target
from eyas.common.cli import HelpFormatter
from eyas.common.profiling import Idle, KernelKind, idle_time, per_step, work_in
from eyas.common.target import default_dtype

from .autotune import format_setting
from .bench import GREEDY, add_draft_vocab_argument, random_head, warm_engine
from .commands import (
    add_device_argument,
    add_engine_arguments,
    add_sampling_arguments,
    engine_options,
    given_flags,
    refuse_unread,
    require_positive,
    sampling_params,
    tree_setting,
)
from .draft import TreeShape
from .engine import step_reserve
from .sampling import SamplingParams, for_prompt

PHASES = ("draft", "verify", "accept")


@dataclass
class PhaseProfile:
    """One phase: launches per decode step, and each kernel kind's share of a step, the most charged first."""

    launches: float
    kernels: list[KernelKind]


def profile_setting(target, head, shape: TreeShape | None, prompt: list[int], new_tokens: int,
                    params: SamplingParams = GREEDY, **options) -> dict[str, PhaseProfile]:
    """Decodes `new_tokens` after `prompt` at batch 1 under the profiler -> one PhaseProfile per phase. `options`:
    EngineConfig fields (`engine_options`)."""
    engine = warm_engine(target, head, shape, [prompt], new_tokens, 1, params, profile=True, **options)
    engine.decode_steps = 0
    cuda = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        engine.generate([prompt], params, new_tokens)
    events = prof.events()
    spans = collections.defaultdict(list)
    for e in events:
        if e.name.startswith("eyas.") and e.device_type == DeviceType.CPU:
            spans[e.name[5:]].append(e)
    works = {phase: work_in(events, spans[phase]) for phase in PHASES}
    steps = max(engine.decode_steps, 1)
    return {phase: PhaseProfile(len(work) / steps, per_step(work, steps)) for phase, work in works.items()}


def idle_setting(target, head, shape: TreeShape | None, prompt: list[int], new_tokens: int,
                 params: SamplingParams = GREEDY, **options) -> tuple[Idle, int]:
    """Decodes `new_tokens` after `prompt` at batch 1 as in serving, steps overlapping, the prefill left out of the
    profile -> the GPU's `Idle` over the decode steps, and their count. `options` as `profile_setting`'s."""
    engine = warm_engine(target, head, shape, [prompt], new_tokens, 1, params, **options)
    request = engine.add_request(prompt, params, new_tokens)
    while not request.output:  # the prefill
        engine.step()
    engine.decode_steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_work():
            engine.step()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return idle_time(kernels), engine.decode_steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.profile", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--arch", default="smollm2-135m", choices=sorted(ARCHITECTURES), help="random weights of")
    parser.add_argument("--trees", type=tree_setting, nargs="+", default=[None, TreeShape(6, 8, 48)],
                        help="settings: off or num_steps,topk,num_draft_tokens (default: off 6,8,48)")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated, their steps profiled")
    add_draft_vocab_argument(parser)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per phase (with --idle: gaps)")
    parser.add_argument("--idle", action="store_true",
                        help="how long the GPU idles a step while steps overlap, as in serving (CUDA only)")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    params = sampling_params(parser, args)
    require_positive(parser, args, "draft_vocab")
    if args.input_len < 1 or args.new_tokens < 2 or args.top < 1:  # two new tokens: one decode step at least
        parser.error(f"need --input-len >= 1, --new-tokens >= 2 and --top >= 1, got {args.input_len}, "
                     f"{args.new_tokens}, {args.top}")
    context = architecture_config(args.arch).max_position_embeddings
    if args.input_len + args.new_tokens + step_reserve([t for t in args.trees if t]) - 1 > context:
        parser.error(f"--input-len {args.input_len} and --new-tokens {args.new_tokens}, with the trees' drafts, pass "
                     f"{args.arch}'s context of {context} tokens")
    if args.idle and not args.device.startswith("cuda"):
        parser.error(f"--idle measures the GPU's idle time: it needs a CUDA device, not {args.device!r}")
    if not args.idle:
        refuse_unread(parser, given_flags(parser, argv), ("disable_overlap",),
                      "the phase profile runs each step alone (its phases timed between syncs); --idle overlaps them")
    options = engine_options(parser, args)
    target = random_target(args.arch, default_dtype(args.device), args.device)
    head = random_head(target, args.draft_vocab)
    prompt = torch.randint(0, target.config.vocab_size, (args.input_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = for_prompt(params, prompt)
    unit = "kernels" if args.device.startswith("cuda") else "operators"
    for shape in args.trees:
        setting = f"{args.arch} {format_setting(shape)}"
        work = (target, head, shape, prompt, args.new_tokens, params)
        if args.idle:
            print_idle(setting, *idle_setting(*work, **options), args.top)
        else:
            print_phases(setting, unit, profile_setting(*work, **options), args.top)


def print_phases(setting: str, unit: str, phases: dict[str, PhaseProfile], top: int) -> None:
    launches = ", ".join(f"{phase} {p.launches:.1f}" for phase, p in phases.items())
    print(f"== {setting}: {unit} a decode step {launches}")
    for phase, p in phases.items():
        for name, launches, us, charged in p.kernels[:top]:
            print(f"  {phase:>6} {launches:6.1f}x {us:8.1f} us, charged {charged:8.1f}  {name[:90]}")


def print_idle(setting: str, idle: Idle, steps: int, top: int) -> None:
    steps = max(steps, 1)
    print(f"== {setting}: {steps} decode steps; a step {idle.span / steps:.1f} us, the GPU busy "
          f"{idle.busy / steps:.1f}, idle {(idle.span - idle.busy) / steps:.1f}")
    for before, after, count, us in idle.gaps[:top]:
        print(f"  {us / steps:8.1f} us a step, {count / steps:5.2f}x  {before[:45]} -> {after[:45]}")


if __name__ == "__main__":
    main()
