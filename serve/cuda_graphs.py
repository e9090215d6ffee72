"""CUDA graphs for the engine's per-step passes: each pass is captured once per input shape and replayed.

A decode step launches hundreds of small kernels (every layer's projections, norms, rotary, attention);
from Python that costs more host time than the GPU needs to run them. Captured in a graph, one replay
launches them all. The engine keeps shapes few and fixed: batch sizes are padded up to `BATCH_BUCKETS`, prefill
chunks to a `length_bucket`, block tables to the context's block count, draft extensions to the tree depth.

    graphs = GraphCache(device, enabled=True)
    out = graphs("verify", forward_fn, tokens, positions, table, prefix, mask)   # same as forward_fn(...)

The function must be a pure function of its tensor arguments (no host synchronisation, no Python
branches on tensor values) and return a tuple of tensors. Writes it makes (KV entries) must be idempotent:
the first call of each shape runs it three times on that call's inputs (two warm-ups, then the replay). The
returned tensors are the graph's static outputs: the next replay of the same graph overwrites them, so callers
copy what they keep. No other graph's replay touches them: the graphs share one memory pool for their scratch
memory, and the outputs live outside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_bucket(batch: int) -> int:
    """The smallest bucket that holds `batch` rows (batches past the last bucket run as they are)."""
    return next((b for b in BATCH_BUCKETS if b >= batch), batch)


def length_bucket(length: int) -> int:
    """The columns a prefill chunk of `length` tokens is padded to: a power of two from 16 to 256, then a multiple of
    256 (a longer chunk pads fewer than 256 columns: under half its compute, under a quarter from 769 tokens on; a
    short one's cost is its launches, not its rows)."""
    if length <= 256:
        return max(16, 1 << (length - 1).bit_length())
    return -(-length // 256) * 256


@functools.cache
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every capture warms up on, one a device for the process: cuBLAS keeps a workspace for each
    stream it has run on until the process ends, so a new stream a capture took one more from PyTorch's pool of 32
    streams; engines built one after another in a benchmark held 1.02 GiB more so on an H200, about 32 MiB a stream
    (docs/perf.md, twenty-sixth entry)."""
    return torch.cuda.Stream(device)


def length_buckets(most: int) -> list[int]:
    """Every length bucket up to `most` tokens."""
    buckets = [16]
    while (nxt := length_bucket(buckets[-1] + 1)) <= most:
        buckets.append(nxt)
    return buckets if most >= 16 else []


class GraphCache:
    """`enabled`: the engine keeps fixed shapes (buckets, full-width tables) and, on CUDA, captures; elsewhere
    the passes run eagerly on the same fixed shapes (how CPU tests cover the padding)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.capture = enabled and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.warmup_stream = _warmup_stream(device) if self.capture else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], tuple[Tensor, ...]]] = {}

    def __call__(self, name: str, fn: Callable[..., tuple[Tensor, ...]], *inputs: Tensor) -> tuple[Tensor, ...]:
        if not self.capture:
            return fn(*inputs)
        key = (name,) + tuple((x.shape, x.dtype) for x in inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(fn, inputs)
        graph, static_inputs, outputs = entry
        for buffer, x in zip(static_inputs, inputs, strict=True):
            buffer.copy_(x, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, fn, inputs):
        static_inputs = [x.clone() for x in inputs]
        # Warm up on a side stream (Triton compiles, the allocator settles), as graph capture requires.
        stream = self.warmup_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                warm = fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        # The outputs outlive the replay (the engine reads a step's verification after the next graph has run), so
        # they live outside the shared pool: a graph captured later may take the pool's free blocks for its scratch
        # memory, and blocks the pool handed out as outputs would then be overwritten whenever that graph replays.
        # The graph copies its results into them.
        outputs = tuple(torch.empty_like(x) for x in warm)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            for buffer, x in zip(outputs, fn(*static_inputs), strict=True):
                buffer.copy_(x)
        return graph, static_inputs, outputs


def replay_ms(run: Callable[[], None], reps: int = 20) -> float:
    """Milliseconds of one replay of a CUDA graph of `run` (the median of `reps`), run once before the capture (its
    kernels compiled, its first-use allocations made): what the benchmarks time kernels by, with no host in between."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]
