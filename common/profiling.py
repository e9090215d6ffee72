"""What ran inside `torch.profiler` ranges, read one way by `python -m eyas.serve.profile` (a decode step's phases)
and `python -m eyas.train.bench --profile` (a training step)."""

from __future__ import annotations

import collections

from torch.autograd import DeviceType


def work_in(events, spans) -> list:
    """The work that starts inside any of `spans` (host-side ranges that each end with a wait for the device, so
    what starts inside also finishes inside): on CUDA the device's kernels and copies, less the device-side copies
    of profiler ranges (the spans' own, torch.compile's), which span kernels; off CUDA the operators each span calls
    directly."""
    if any(e.device_type == DeviceType.CUDA for e in events):
        ranges = [(s.time_range.start, s.time_range.end) for s in spans]
        return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                and any(start <= e.time_range.start <= end for start, end in ranges)]
    return [op for s in spans for op in s.cpu_children]


def per_step(work, steps: int) -> list[tuple[str, float, float]]:
    """(name, launches a step, µs a step) of each kind of `work`, the costliest first."""
    launches, micros = collections.Counter(e.name for e in work), collections.Counter()
    for e in work:
        micros[e.name] += e.time_range.elapsed_us()
    steps = max(steps, 1)
    return [(name, launches[name] / steps, us / steps) for name, us in micros.most_common()]
