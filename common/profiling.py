"""What ran inside `torch.profiler` ranges, read one way by `python -m eyas.serve.profile` (a decode step's phases,
and with --idle the device's idle time between kernels) and `python -m eyas.train.bench --profile` (a training
step)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

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


class KernelKind(NamedTuple):
    """One kind of work (a kernel's or an operator's name) over a run, a step's share: its launches, the µs its runs
    took (under programmatic dependent launch a kernel's run holds its wait on the kernel before), and the µs it is
    charged (`charged_us`): over a run the charges add up to its busy time."""

    name: str
    launches: float
    us: float
    charged_us: float


def per_step(work, steps: int) -> list[KernelKind]:
    """Each kind of `work` a step, the most charged first."""
    launches, micros = collections.Counter(e.name for e in work), collections.Counter()
    for e in work:
        micros[e.name] += e.time_range.end - e.time_range.start
    charged = charged_us(work)
    steps = max(steps, 1)
    return sorted((KernelKind(name, launches[name] / steps, micros[name] / steps, charged[name] / steps)
                   for name in launches), key=lambda k: -k.charged_us)


def charged_us(work) -> collections.Counter:
    """µs charged to each name of `work` (events with a time range, µs; they may overlap): in order of start, what
    each moves the end of the work before it, so a kernel launched early under programmatic dependent launch is
    charged from where the one before it ended, and overlapped time is charged once."""
    charged = collections.Counter()
    for e, charge, _, _ in _after_the_work_before(work):
        charged[e.name] += charge
    return charged


def _after_the_work_before(work):
    """Each event of `work` in order of start, with its charge (`charged_us`), the end of the work before it (-inf for
    the first) and the event that ended last there (None for the first)."""
    end, last = float("-inf"), None
    for e in sorted(work, key=lambda e: e.time_range.start):
        yield e, max(0.0, e.time_range.end - max(end, e.time_range.start)), end, last
        if e.time_range.end > end:
            end, last = e.time_range.end, e


@dataclass
class Idle:
    """The device's time across a run of kernels, µs: from the first one's start to the last one's end (`span`), the
    union of their busy time (`busy`), and each gap between them longer than a threshold, by the kernels around it:
    (the kernel before, the kernel after, how many such gaps, their µs), the longest total first."""

    span: float
    busy: float
    gaps: list[tuple[str, str, int, float]]


def idle_time(kernels, min_gap_us: float = 3.0) -> Idle:
    """`Idle` of device events (each with a name and a time range, µs; they may overlap, as kernels under
    programmatic dependent launch do)."""
    if not kernels:
        return Idle(0.0, 0.0, [])
    gaps = collections.defaultdict(lambda: [0, 0.0])
    busy, first, finish = 0.0, None, float("-inf")
    for e, charge, end, last in _after_the_work_before(kernels):
        busy += charge
        first = e if first is None else first
        finish = max(finish, e.time_range.end)
        if last is not None and e.time_range.start - end > min_gap_us:  # the device idled from `end` on
            gap = gaps[last.name, e.name]
            gap[0] += 1
            gap[1] += e.time_range.start - end
    return Idle(finish - first.time_range.start, busy,
                sorted(((a, b, n, us) for (a, b), (n, us) in gaps.items()), key=lambda g: -g[3]))
