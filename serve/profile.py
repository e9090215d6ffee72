"""Kernels per decode-step phase: where a batch-1 step's launches go, setting by setting.

    python -m eyas.serve.profile --arch smollm2-135m --trees off 6,8,48
    python -m eyas.serve.profile --arch llama-3.1-8b --trees 5,4,8 --temperature 0.8 --top-p 0.9   # sampled

A small model's step is bound by how many kernels it launches, not by bytes, and only the launches of the draft, the
accept phase and verification's extra over a plain pass set the speedup of speculation. For each setting this runs
an engine on random weights of --arch (a step's kernels do not depend on the weights) at batch 1, a prompt of
--input-len random tokens, and profiles --new-tokens of decoding with `torch.profiler` (after an untimed run of the
same generation, which captures the CUDA graphs and compiles the kernels), greedy unless --temperature. The engine
times its phases between syncs, so each phase's device work lies inside its span (`Engine._phase`). Per phase it
prints the kernels a step and the costliest kernels: counts are exact; times carry the profiler's overhead
(bench-eagle measures step times). On Hopper a Triton kernel's time also holds its wait on the kernel before
(programmatic dependent launch starts it early: `eyas.serve.kernels.launch_options`). Off CUDA it counts the torch
operators each phase calls instead.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from eyas.common.architectures import ARCHITECTURES, random_target
from eyas.common.profiling import per_step, work_in
from eyas.common.target import default_dtype

from .autotune import format_setting
from .bench import GREEDY, random_head, warm_engine
from .commands import add_sampling_arguments, sampling_params, tree_setting
from .draft import TreeShape
from .sampling import SamplingParams

PHASES = ("draft", "verify", "accept")


@dataclass
class PhaseProfile:
    """One phase: launches per decode step, and (name, launches per step, µs per step) of each kernel kind."""

    launches: float
    kernels: list[tuple[str, float, float]]


def profile_setting(target, head, shape: TreeShape | None, prompt: list[int], new_tokens: int,
                    params: SamplingParams = GREEDY) -> dict[str, PhaseProfile]:
    """Decodes `new_tokens` after `prompt` at batch 1 under the profiler -> one PhaseProfile per phase."""
    engine = warm_engine(target, head, shape, [prompt], new_tokens, 1, params, profile=True)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.profile", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="smollm2-135m", choices=sorted(ARCHITECTURES))
    parser.add_argument("--trees", type=tree_setting, nargs="+", default=[None, TreeShape(6, 8, 48)],
                        help="settings: off or num_steps,topk,num_draft_tokens (default: off 6,8,48)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per phase")
    add_sampling_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    params = sampling_params(parser, args)
    target = random_target(args.arch, default_dtype(args.device), args.device)
    head = random_head(target)
    prompt = torch.randint(0, target.config.vocab_size, (args.input_len,), generator=torch.Generator().manual_seed(0))
    unit = "kernels" if args.device.startswith("cuda") else "operators"
    for shape in args.trees:
        phases = profile_setting(target, head, shape, prompt.tolist(), args.new_tokens, params)
        print(f"== {args.arch} {format_setting(shape)}: {unit} a decode step "
              + ", ".join(f"{phase} {p.launches:.1f}" for phase, p in phases.items()))
        for phase, p in phases.items():
            for name, launches, us in p.kernels[: args.top]:
                print(f"  {phase:>6} {launches:6.1f}x {us:8.1f} us  {name[:100]}")


if __name__ == "__main__":
    main()
