"""The serving engine: continuous batching over a paged KV cache, with tree speculative decoding.

    engine = Engine(target, head, EngineConfig(tree=TreeShape(5, 4, 8)))
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0), max_new_tokens=128, stop_ids={2})
    while engine.has_work():
        engine.step()
    request.output   # token ids

Each `step` either prefills one chunk of each of as many admitted requests as fit `max_prefill_tokens`, or
runs one decode step for every running request. A decode step drafts a tree per request (`draft.py`),
verifies all its nodes in one target pass under a tree mask, accepts a path (`verify.py`), extends the draft with
the accepted tokens' target states and moves the accepted nodes' KV into place (`accept.py`). Without a head
(or with speculation off) the tree is the root alone, so the same code decodes one token a step: the
baseline every comparison uses.

Per batch size the step may draft a different tree, or none (`EngineConfig.tree_by_batch`, from
`bench-eagle --autotune`). A step that drafts none leaves the draft behind: it costs what decoding without a head
costs. When the batch size calls for speculation again, the requests whose draft is behind go back to their last
drafted position, and a prefill recomputes the positions since (`Engine._catch_up_drafts`).

A decode step stays in flight: the next `step` queues the one after it from its device outputs before reading
its tokens (`Engine.step`), so the host's scheduling and bookkeeping overlap the device's work.

On CUDA with the triton backend a decode step replays three CUDA graphs (`cuda_graphs.py`): the tree drafting, the
target pass with its verification (greedy or sampled), and the draft's extension along the accepted path with its
inputs; a prefill chunk replays one (the target pass, the prompt's first token and the draft's extension). Batches
are padded to a bucket, prefill chunks to a length bucket, block tables to full width. On CUDA the models'
elementwise work and one-token projections, the draft's top-k, the draft tree's bookkeeping, verification's walks
(greedy and sampled), its top-k / top-p filter and the accept phase's bookkeeping (`accept.py`) run as fused Triton
kernels (the layers' `kernels.py`, the rest `step_kernels.py`); each graph looks its rotary tables up (`rope.py`).
On every device the engine joins each layer's q/k/v projections, and its MLP's gate/up, into one matmul each
(`common.layers.fuse_projections`), folds the models' norm weights into the projections they feed (their
`fold_norms`: what is left of such a norm, 1 / RMS, the few-rows kernel applies to its sums, and SiLU·mul after
cuBLAS's gate/up; a split or float8 few-rows call, and cuBLAS's other projections, still launch it as a norm of their
inputs), and with `draft_fp8` rounds the head's linear weights to float8, whose copies the kernels read (`fp8.py`).

Requests own blocks of the shared pool (target and draft pools share block ids: position p of a request
lives in the same slot in both). Admission waits for free blocks, a block to spare for each running request besides;
a decode step that cannot get blocks preempts the newest request (its KV is freed and recomputed on readmission)
instead of failing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm import tqdm

from eyas.common.attention import causal_mask
from eyas.common.config import ConfigError
from eyas.common.head_checkpoint import DraftHead
from eyas.common.layers import fuse_projections
from eyas.common.target import TargetModel, TargetOutput

from .accept import TORCH_ACCEPT
from .attention import attention_backend
from .attention.paged import slots_of
from .autotune import TreeByBatch, format_setting, setting_for
from .cuda_graphs import GraphCache, batch_bucket, length_bucket, length_buckets
from .draft import Drafter, DraftState, TreeShape, draft_states
from .fp8 import quantize_linears
from .kv_cache import KVPool
from .rope import rope_tables
from .sampling import TORCH_PROBS, SamplingParams, SamplingRows, request_seed
from .transfer import to_device
from .tree import DraftKernels, DraftTree, gather_rows, root_only
from .verify import follow_targets, verify_greedy, walk_sampling


@dataclass(frozen=True)
class EngineConfig:
    speculative: bool = True  # False: one token per step even when a head is loaded
    tree: TreeShape = field(default_factory=TreeShape)
    # Per batch size, the tree (or None: no speculation) that measured fastest (`autotune.py`); empty: `tree`.
    tree_by_batch: TreeByBatch = ()
    block_size: int = 16
    num_blocks: int | None = None  # None: `mem_fraction` of free GPU memory, or `cpu_kv_tokens` on CPU
    mem_fraction: float = 0.85
    cpu_kv_tokens: int = 65536
    max_batch_size: int = 64
    max_prefill_tokens: int = 2048  # chunk size of prefills
    profile: bool = False  # time each phase (synchronising the device): `Engine.timings`
    attention: str = "auto"  # attention backend: auto, torch, triton or flashinfer (serve/attention)
    cuda_graphs: bool = True  # replay decode-step passes as CUDA graphs (CUDA, with a graph-safe backend)
    # Queue a decode step before the last one's tokens reach the host (`Engine.step`): the host's work between
    # steps then runs while the device computes. Off while profiling.
    overlap: bool = True
    # The draft head's linear weights rounded to float8 (`fp8.py`; the head is changed in place): on CUDA its one-row
    # passes, and its large weights at up to 16 rows, read half the bytes. The served tokens stay the target's; the
    # acceptance may change.
    draft_fp8: bool = False

    def __post_init__(self):
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if min(self.block_size, self.max_batch_size, self.max_prefill_tokens, self.cpu_kv_tokens) < 1:
            raise ConfigError("block_size, max_batch_size, max_prefill_tokens and cpu_kv_tokens must be positive")


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (the worker's, when a step failed)
    # Speculative statistics: one entry per verification of a drafted tree, the draft tokens it accepted.
    accepted: list[int] = field(default_factory=list)
    # Engine state.
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # positions whose target KV is in the pool
    drafted: int = 0  # positions whose draft KV is in the pool: `cached`, or fewer after steps that drafted nothing
    draft: DraftState | None = None
    seed: int = 0  # the request's draws (`sampling.position_uniforms`; `sampling.request_seed`)
    emitted: int = 0  # len(output) already handed out by `take_new_tokens`

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_target(self) -> int:
        """Positions to prefill: the whole prompt, or (after a preemption) all but the pending root.
        (Read every step: arithmetic, not `tokens`, which copies the whole sequence.)"""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def content(self) -> list[int]:
        """The output without the stop token that ended it: what a reader of the answer gets."""
        return self.output[:-1] if self.output and self.output[-1] in self.stop_ids else self.output

    @property
    def last_token(self) -> int:
        return (self.output or self.prompt)[-1]

    def take_new_tokens(self) -> list[int]:
        new = self.output[self.emitted :]
        self.emitted = len(self.output)
        return new


@dataclass(eq=False)
class DecodeStep:
    """A decode step whose work is queued on the device: what the step after it starts from (B' rows, padding
    included) and what `Engine._finish_decode` hands out once the device is done."""

    requests: list[Request]
    advance: int  # the most positions a request can gain in it: the accepted path and the bonus token
    n: Tensor  # [B'] cached positions before it
    num_accepted: Tensor  # [B'] draft tokens accepted
    bonus: Tensor  # [B'] the token after the accepted path, the next root
    draft: tuple[Tensor, Tensor] | None  # the draft's hidden [B', H] and logits [B', Vd] after it; None: no tree
    host: Tensor  # [B, 2 + 2N]: num_accepted, bonus, accepted path, tree tokens; on the host once `ready`
    ready: torch.cuda.Event | None  # None: already there (off CUDA)


class PromptTooLong(ValueError):
    """A prompt that leaves no room in the context to answer it."""


class Engine:
    def __init__(self, target: TargetModel, head: DraftHead | None = None, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.target = target
        self.device = target.embed_tokens.weight.device
        self.attention = attention_backend(self.config.attention, self.device)
        draft_kernels = DraftKernels()  # the draft's best children per node, the tree's bookkeeping
        # What the target pass's graph verifies with.
        self.verify_greedy, self.follow_targets, self.probs_kernels = verify_greedy, follow_targets, TORCH_PROBS
        self.accept_kernels = TORCH_ACCEPT  # the accept phase's bookkeeping
        fused = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        if fused:
            from . import kernels, step_kernels

            torch.cuda.set_device(self.device)  # Triton launches on the current device
            draft_kernels = step_kernels.DRAFT
            self.verify_greedy, self.follow_targets = step_kernels.verify_greedy, step_kernels.follow_targets
            self.probs_kernels = step_kernels.PROBS
            self.accept_kernels = step_kernels.ACCEPT
        # A speculative step's kernels let the next launch as they end on a target whose matmuls stream tens of µs
        # a call (`kernels.releasing_late`); plain steps' launch at once.
        self.releasing_late = (kernels.releasing_late if fused and target.config.hidden_size >= kernels.ROWS_LONG_MIN_K
                               else lambda on: contextlib.nullcontext())
        dtype = target.embed_tokens.weight.dtype
        tcfg = target.config
        if not self.config.speculative:
            head = None  # plain decoding: the head is neither run nor given KV memory
        for model in (target, head):
            if model is not None:
                fuse_projections(model)  # q/k/v and gate/up as one matmul each (in place: the caller's models too)
                model.fold_norms()  # the norms' weights into the projections they feed (`fold_norm`)
        fp8_copies = quantize_linears(head) if head is not None and self.config.draft_fp8 else None
        if fused:  # fused elementwise kernels (the layers' torch ones are the reference)
            kernels.install(target)
            if head is not None:
                kernels.install(head, kernels.with_fp8(fp8_copies) if fp8_copies is not None else None)
        # The rotary tables of every position a decode step can read (`rope.py`), the target's and the head's, built
        # before the KV pool takes its share of the free memory.
        rope = rope_tables([target.rotary] + ([head.rotary] if head is not None else []), tcfg.max_position_embeddings,
                           dtype)
        self.rope = rope[0]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the separate weights' memory, cached by the allocator, is free for the KV pool
        self.tree_by_batch = (self.config.tree_by_batch or ((1, self.config.tree),)) if head is not None else ()
        self.trees = [shape for _, shape in self.tree_by_batch if shape is not None]
        self.reserve = step_reserve(self.trees)
        bs = self.config.block_size
        num_blocks = self.config.num_blocks or self._auto_blocks(head, dtype)
        self.pool = KVPool(tcfg.num_hidden_layers, num_blocks, bs, tcfg.num_key_value_heads, tcfg.head_dim,
                           dtype, self.device)
        self.graphs = GraphCache(self.device, self.config.cuda_graphs and self.attention.graph_safe)
        # Positions a request may reach: the model's context, and no more than the whole pool.
        self.context_limit = min(tcfg.max_position_embeddings, num_blocks * bs)
        if head is not None and head.config.hidden_size != tcfg.hidden_size:  # else a shape error at the first draft
            raise ConfigError(f"the head's hidden size {head.config.hidden_size} is not the target's "
                              f"{tcfg.hidden_size}: the draft embeds its tokens with the target's embedding (a head "
                              "that carries its own is not served)")
        for shape in self.trees:  # refused here, not at a request's first step
            if shape.topk > head.draft_vocab_size:
                raise ConfigError(f"tree {format_setting(shape)}: topk {shape.topk} is more than the head's draft "
                                  f"vocabulary of {head.draft_vocab_size} tokens")
        if self.reserve >= self.context_limit:
            raise ConfigError(f"trees {[format_setting(t) for t in self.trees]} need {self.reserve} positions a step "
                              f"beyond the prompt; the context holds {self.context_limit}")
        self.aux_layers: tuple[int, ...] = ()
        self.drafter = None  # None: no speculation
        if head is not None:
            hc = head.config
            draft_pool = KVPool(head.kv_layers, num_blocks, bs, hc.num_key_value_heads, hc.head_dim, dtype,
                                self.device)
            draft_pool.allocator = self.pool.allocator  # one block table per request serves both pools
            self.drafter = Drafter(head, target, draft_pool, self.attention, self.graphs, draft_kernels, rope[1])
            self.aux_layers = head.target_layers(tcfg)
        # Graphs need fixed shapes: every block table is as wide as the longest request can need.
        self.table_width = self._blocks_for(self.context_limit) if self.graphs.enabled else None
        self._last_table: tuple[tuple, Tensor] | None = None  # (its rows' blocks, padding, width), the table
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: DecodeStep | None = None  # a decode step queued on the device, its tokens not yet handed out
        # While `profile` (from the config; a benchmark may switch it): seconds per phase (prefill, and each decode
        # step's draft, verify and accept, within its whole "decode") and the decode step count.
        self.profile = self.config.profile
        self.timings: defaultdict[str, float] = defaultdict(float)
        self.decode_steps = 0
        self.preemptions = self.recomputed = 0  # requests preempted, and the positions of KV they lost

    @contextmanager
    def _phase(self, name: str):
        """While profiling: the phase's time, between syncs, so its device work runs inside its span; the span is
        a `torch.profiler` range `eyas.NAME` too (`eyas.serve.profile` counts the kernels in it)."""
        if not self.profile:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.profiler.record_function(f"eyas.{name}"):
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.timings[name] += time.perf_counter() - start

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int, stop_ids=frozenset()
    ) -> Request:
        """Queues a request. Raises ValueError when it can never run: empty, longer than the context, or holding a
        token the target cannot embed (whose lookup inside a step would end every running request)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if self.room(len(prompt)) < 1:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; this server's context holds {self.context_limit - self.reserve}"
            )
        vocab = self.target.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(i for i in prompt if not 0 <= i < vocab)
            raise ValueError(f"token id {bad} of the prompt is not in the target's vocabulary [0, {vocab})")
        request = Request(list(prompt), params, max_new_tokens, frozenset(stop_ids))
        request.seed = request_seed(params)
        self.waiting.append(request)
        return request

    def room(self, prompt_len: int) -> int:
        """New tokens that a prompt of `prompt_len` tokens surely has room for in this engine's context (< 1: it
        cannot run): the prefill's, then one a decode step while a step's tree fits (`reserve`); a speculative
        step may add a few more."""
        return self.context_limit - self.reserve - prompt_len + 1

    def abort(self, request: Request) -> None:
        """Ends a request now and frees its blocks (a client that went away)."""
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], max_new_tokens: int,
                 stop_ids=()):
        """Runs `prompts` to completion in one continuous batch, with `params` (or each prompt with its own); returns
        their requests (in order)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(p, q, max_new_tokens, stop_ids) for p, q in zip(prompts, each, strict=True)]
        while self.has_work():
            self.step()
        return requests

    def warm_up(self, new_tokens: int = 16, progress: bool = False, params: SamplingParams | None = None) -> None:
        """Before serving: at each batch size `_warm_batch_sizes` gives (each bucket's graphs with each tree setting a
        batch padded to it drafts, as autotuned), a greedy generation of `new_tokens` on prompts of 31 and 32 tokens
        (Triton compiles a kernel variant for lengths that are a multiple of 16 and one for the rest), then a decode
        step of sampled requests, without and with top-p, all sampled and (past one request) beside a greedy one (each
        verifies in a graph of its own: `_verification`); then for each other length bucket, prompts of it at each
        batch bucket whose prefill step holds them and whose blocks the pool has (`_prefill_warm_sizes`), greedy and
        sampled alike (`_prefill`'s graphs, each sampling the first tokens its way: captured while serving, a batch's
        first long prefill waited 0.05-0.9 s; warmed, as long as its next within 1.5 ms: docs/perf.md, sixtieth and
        sixty-first entries). The CUDA graphs are captured and the
        kernels compiled before a request waits for them: seconds, which the first requests would otherwise pay.
        `params`: a run's own setting, warmed up as well where it samples (eval-eagle's, which may filter by top-k).
        Leaves no request and every block free. `progress`: a bar on stderr, a step per batch size and per length."""
        vocab = self.target.config.vocab_size
        sizes = self._warm_batch_sizes()
        # The decode steps' prompts fill the 32-token bucket; every other that fits the context is warmed up alone.
        lengths = [n for n in length_buckets(self.config.max_prefill_tokens) if n != 32 and self.room(n) >= 1]
        bar = tqdm(total=len(sizes) + len(lengths), desc="warming up", unit="step", disable=not progress,
                   file=sys.stderr)
        sampled_settings = (SamplingParams(), SamplingParams(top_p=0.95),
                            *([params] if params and not params.greedy else []))
        with bar:
            for batch in sizes:  # greedy decode steps, then one sampled step (after the prefill's token) each way
                prompts = [[(7 * i + j) % vocab for j in range(31 + i % 2)] for i in range(batch)]
                self._generate_each_way(prompts, sampled_settings, new_tokens, 2)
                bar.update()
            for n in lengths:  # the prefill alone
                for batch in self._prefill_warm_sizes(n, sizes):
                    self._generate_each_way([[(7 * (i + j)) % vocab for j in range(n)] for i in range(batch)],
                                            sampled_settings, 1, 1)
                bar.update()

    def _generate_each_way(self, prompts: list[list[int]], sampled_settings: tuple[SamplingParams, ...],
                           greedy_tokens: int, sampled_tokens: int) -> None:
        """`prompts` generated greedily, then with each sampled setting, all sampled and (past one prompt) beside a
        greedy one: each way verifies, and samples a prefill's first tokens, in graphs of its own."""
        greedy = SamplingParams(temperature=0)
        self.generate(prompts, greedy, greedy_tokens)
        for sampled in sampled_settings:
            self.generate(prompts, sampled, sampled_tokens)
            if len(prompts) > 1:
                self.generate(prompts, [greedy] + [sampled] * (len(prompts) - 1), sampled_tokens)

    def _prefill_warm_sizes(self, length: int, sizes: list[int]) -> list[int]:
        """Of the warmed batch sizes `sizes` (ascending), the largest in each bucket whose prompts of `length` tokens
        prefill in one step (its padded rows and columns within max_prefill_tokens, as `_prefill_batch` groups them)
        and are admitted together (`blocks_to_admit`)."""
        largest = {batch_bucket(b): b for b in sizes}
        need = self._blocks_for(length + self.reserve)
        return [b for bucket, b in largest.items() if bucket * length <= self.config.max_prefill_tokens
                and blocks_to_admit(need, b) <= self.pool.allocator.num_free]

    def _warm_batch_sizes(self) -> list[int]:
        """A batch size for each pair of batch bucket and tree setting a decode step can run, the largest: the buckets
        up to max_batch_size, and where an autotuned table's setting changes inside a bucket (a key that is not a
        bucket: {"3": tree, "8": "off"} drafts at 3 requests, padded to 4, and not at 4), the size before the
        change too. Else such a batch would capture its graphs while serving (seconds, and memory the KV pool was
        sized without)."""
        largest = {}
        for batch in range(1, self.config.max_batch_size + 1):
            setting = setting_for(self.tree_by_batch, batch) if self.tree_by_batch else None
            largest[batch_bucket(batch), setting] = batch
        return sorted(largest.values())

    # ---- scheduling -----------------------------------------------------------------------------

    def step(self) -> None:
        """One prefill or decode step. A decode step is left in flight (`in_flight`): the next call queues
        the step after it from its device outputs (the same requests, blocks for the most it can accept) and only
        then waits for its tokens and hands them out, so the host's work between steps overlaps the device's. What
        the chained step computed for a request that ended meanwhile is dropped."""
        last, self.in_flight = self.in_flight, None
        if last is not None:
            chained = self._overlaps() and self._can_chain(last)
            if chained:
                self._launch_decode(last.requests, after=last)
            self._finish_decode(last)
            if chained:
                return
        self._admit()
        self._catch_up_drafts()
        pending = self._prefill_batch()
        if pending:
            with self._phase("prefill"):
                self._prefill(pending)
        elif self.running:
            self._launch_decode(self._ensure_blocks())

    def _launch_decode(self, requests: list[Request], after: DecodeStep | None = None) -> None:
        self.decode_steps += 1
        with self._phase("decode"):  # the three phases and the host work between them
            self.in_flight = self._decode(requests, after)

    def _catch_up_drafts(self) -> None:
        """Where the running batch's size calls for a tree, the requests whose draft is behind (steps at a size without
        speculation do not extend it) go back to their last drafted position: the next prefill steps recompute the
        target's KV there as it was, and extend the draft over it. Each position is recomputed once at most, so a
        batch size without speculation runs as fast as a server without a head."""
        if not self._speculates(len(self.running)):
            return
        for request in self.running:
            request.cached = min(request.cached, request.drafted)

    def _speculates(self, batch: int) -> bool:
        """Whether a decode step of `batch` requests drafts a tree once every draft is current."""
        return self.drafter is not None and setting_for(self.tree_by_batch, batch) is not None

    def _setting(self, requests: list[Request]) -> TreeShape | None:
        """The tree a decode step of `requests` drafts: their batch size's, or none without a head, or while a draft
        is behind (a batch that shrank by a preemption after `_catch_up_drafts`; the next step catches it up)."""
        if self.drafter is None:
            return None
        shape = setting_for(self.tree_by_batch, len(requests))
        return None if shape is None or any(r.drafted < r.cached for r in requests) else shape

    def _prefill_batch(self) -> list[Request]:
        """The requests whose prompts this step prefills: one chunk each, as many as fit `max_prefill_tokens`
        once padded to the longest chunk, and with graphs to its batch and length buckets, so that the chunk runs as
        a graph (the first one always): a small model's eager prefill step costs as much as ten graphed ones
        (docs/perf.md), and of 64 ShareGPT prompts, grouped by their unpadded shape, 4 of 11 steps ran eagerly."""
        batch, longest = [], 0
        for r in self.running:
            n = self._chunk_length(r)
            if n <= 0:
                continue
            rows, columns = self._padded(len(batch) + 1, max(longest, n))
            if batch and rows * columns > self.config.max_prefill_tokens:
                break
            batch.append(r)
            longest = max(longest, n)
        return batch

    def _chunk_length(self, r: Request) -> int:
        """The tokens of its prompt a prefill step takes next (0: none left)."""
        return min(r.prefill_target - r.cached, self.config.max_prefill_tokens)

    def _padded(self, rows: int, columns: int) -> tuple[int, int]:
        """A prefill pass's shape as it runs: with graphs, padded to its batch and length buckets."""
        return (batch_bucket(rows), length_bucket(columns)) if self.graphs.enabled else (rows, columns)

    def _blocks_for(self, positions: int) -> int:
        return -(-positions // self.pool.block_size)

    def _admit(self) -> None:
        while need := self._admissible():
            request = self.waiting.popleft()
            request.blocks = self.pool.allocator.allocate(need)
            self.running.append(request)

    def _admissible(self) -> int:
        """The blocks the first waiting request needs, if it can be admitted now; else 0. Admitted, it leaves a free
        block for each running request (its next `block_size` tokens): else the running requests' growth soon
        preempts the newest, whose KV is then computed again. Under a short pool that held a queue of 256 requests
        (SmolLM2, no head, one H100) from 185 preemptions to 30 and took its 3.26 s to 3.07; an 8B target's 64 from
        42 to 17, 6.45 s to 6.27 (docs/perf.md, sixtieth entry)."""
        if not self.waiting or len(self.running) >= self.config.max_batch_size:
            return 0
        request = self.waiting[0]
        need = self._blocks_for(len(request.prompt) + len(request.output) + self.reserve)
        return need if need + len(self.running) <= self.pool.allocator.num_free else 0

    def _can_chain(self, last: DecodeStep) -> bool:
        """Whether the step after `last` may be queued before `last`'s tokens are read: the same requests still run,
        not all of them end with `last`'s tokens, none waits that could be admitted, no draft is due to catch up
        (`last` drafted no tree at a batch size that speculates: chained, every later step would decode plainly too),
        and each has room (blocks, then context) for the most `last` can accept and the next step's tree. Gives them
        the blocks."""
        requests = last.requests
        if (self.running != requests or self._admissible() or (last.draft is None and self._speculates(len(requests)))
                or all(len(r.output) + 1 >= r.max_new_tokens for r in requests)):
            return False
        reach = [r.cached + last.advance + self.reserve for r in requests]  # positions the next step may write
        if max(reach) > self.context_limit:
            return False
        short, need = self._shortfall(requests, reach)
        if need > self.pool.allocator.num_free:
            return False
        self._grant(requests, short)
        return True

    def _shortfall(self, requests: list[Request], reach: list[int]) -> tuple[list[int], int]:
        """The blocks each request lacks to hold `reach` positions (negative: a surplus), and their total."""
        short = [self._blocks_for(x) - len(r.blocks) for r, x in zip(requests, reach, strict=True)]
        return short, sum(max(n, 0) for n in short)

    def _grant(self, requests: list[Request], short: list[int]) -> None:
        for request, n in zip(requests, short, strict=True):
            if n > 0:
                request.blocks += self.pool.allocator.allocate(n)  # kv_cache.OutOfBlocks only if one request overflows

    def _ensure_blocks(self) -> list[Request]:
        """Gives every running request blocks for this decode step, preempting the newest when short."""
        while True:
            short, need = self._shortfall(self.running, [r.cached + self.reserve for r in self.running])
            if need <= self.pool.allocator.num_free or len(self.running) == 1:
                break
            self._preempt(self.running[-1])
        self._grant(self.running, short)
        return list(self.running)  # a copy: finishing requests leave `self.running` during the step

    def _preempt(self, request: Request) -> None:
        self.preemptions += 1
        self.recomputed += request.cached  # the positions its readmission prefills again
        self.running.remove(request)
        self.pool.allocator.free(request.blocks)
        request.blocks, request.cached, request.drafted, request.draft = [], 0, 0, None
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: str) -> None:
        if request.finish_reason is None:
            request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        if request.blocks:
            self.pool.allocator.free(request.blocks)
            request.blocks = []

    # ---- model passes ---------------------------------------------------------------------------

    def _block_table(self, requests: list[Request], padding_rows: int = 0, width: int | None = None) -> Tensor:
        """[B + padding_rows, W] (`KVPool.block_table`), at least `table_width` wide when graphs need fixed shapes.
        The last table is kept and handed out again while its rows' blocks are the same: a decode step mostly is
        (a request takes a block every `block_size` tokens), and building one is about 0.15 ms of host time a step,
        which bounds a small model's plain step (docs/perf.md). Every user only reads it."""
        width = max(self.table_width or 0, width or 0)
        key = (tuple(tuple(r.blocks) for r in requests), padding_rows, width)
        if self._last_table is None or self._last_table[0] != key:
            self._last_table = key, self.pool.block_table(key[0], self.device, width, padding_rows)
        return self._last_table[1]

    @torch.no_grad()
    def _prefill(self, requests: list[Request]) -> None:
        """One chunk of each request's prompt in one target pass, with the first token of each prompt it finishes
        and the draft's extension over the chunk. Rows are padded to the longest chunk (the padding queries' k/v land
        past each row's cached positions, or in the scratch block, and are rewritten later; past the context's end
        their rotary angles are its last position's). With graphs the batch is padded further to its bucket and the
        chunks to their `length_bucket`, and the pass is a graph replay, wherever the padded positions stay in the
        context and the padded batch within `max_prefill_tokens`: run eagerly, a small model's prefill takes longer
        to launch from Python than to compute (docs/perf.md)."""
        starts = [r.cached for r in requests]
        ends = [r.cached + self._chunk_length(r) for r in requests]
        B, T = len(requests), max(e - s for s, e in zip(starts, ends, strict=True))
        rows, columns = self._padded(B, T)
        graphed = (self.graphs.enabled and rows * columns <= self.config.max_prefill_tokens
                   and max(starts) + columns <= self.context_limit)
        pad, T = (rows - B, columns) if graphed else (0, T)
        # The prompts this chunk finishes: their first token comes from the last position.
        first = [b for b, r in enumerate(requests) if ends[b] == r.prefill_target and not r.output]
        # Per row [its chunk (T) | the token after each position (T), what the draft reads there | start | last index
        # | whether it is in `first`], padded with 0, in one copy. At a prompt's last position the draft reads its
        # first token, which the pass puts there.
        host = torch.zeros(B + pad, 2 * T + 3, dtype=torch.long)
        for b, (r, s, e) in enumerate(zip(requests, starts, ends, strict=True)):
            ids = r.tokens
            own, after = ids[s:e], ids[s + 1 : e + 1]
            host[b, : len(own)] = torch.tensor(own)
            host[b, T : T + len(after)] = torch.tensor(after)
            host[b, 2 * T :] = torch.tensor([s, len(own) - 1, b in first])
        ids = to_device(host, self.device)
        # Wide enough for every padded position (past a row's blocks: the scratch block).
        table = self._block_table(requests, pad, width=self._blocks_for(max(starts) + T))
        name, verify, verify_inputs = self._verification(0, self._sampling(requests, pad, first))
        inputs = (ids[:, :T], ids[:, T : 2 * T], ids[:, 2 * T], ids[:, 2 * T + 1], ids[:, 2 * T + 2] != 0, table,
                  *verify_inputs)
        forward = functools.partial(self._prefill_forward, verify)
        first_token, *draft = self.graphs(f"prefill, {name}", forward, *inputs) if graphed else forward(*inputs)
        if draft:  # copies: a graph's outputs are overwritten by its next replay
            states = draft_states(*(x[:B].clone() for x in draft))
        for r, e in zip(requests, ends, strict=True):
            r.cached = e
        if first:
            tokens = first_token.tolist()
            for b in first:
                self._emit(requests[b], [tokens[b]])
        if draft:
            for r, state in zip(requests, states, strict=True):
                if not r.finished:
                    r.draft, r.drafted = state, r.cached

    def _prefill_forward(self, verify, tokens: Tensor, next_tokens: Tensor, prefix: Tensor, last: Tensor,
                         first: Tensor, table: Tensor, *verify_inputs: Tensor) -> tuple[Tensor, ...]:
        """The target pass over chunks tokens [B, T] at positions prefix + t, causal; the token after each row's last
        index (`verify` of the root alone: greedy, or sampled with `verify_inputs`), which rows `first` [B] take as
        the next token there; then the draft's extension with next_tokens [B, T]. -> that token [B], and with a head
        the draft's hidden [B, H] and logits [B, Vd] at each row's last index."""
        B, T = tokens.shape
        positions = prefix[:, None] + torch.arange(T, device=tokens.device)
        slots = slots_of(table, positions, self.pool.block_size)
        mask = _causal_mask(T, tokens.device)
        # A short last chunk padded beside a longer one may reach past the context's end, past the rotary tables:
        # its padding takes the last position's angles (its outputs are never read).
        angles_at = positions.clamp(max=self.context_limit - 1)
        out = self.target(tokens, self.rope(angles_at),
                          self.attention(self.pool, table, prefix, mask.expand(B, T, T), new_slots=slots),
                          aux_layers=self.aux_layers)
        hidden = gather_rows(out.hidden, last[:, None])  # [B, 1, H]
        root = root_only(tokens.gather(1, last[:, None])[:, 0])
        logits = self.target.logits(hidden)  # [B, 1, V]
        _, _, token = verify(root.tokens, root.parents, logits, torch.ones_like(root.tokens, dtype=torch.bool),
                             positions.gather(1, last[:, None]), *verify_inputs)
        if self.drafter is None:
            return (token,)
        at_last = torch.where(first, token, next_tokens.gather(1, last[:, None])[:, 0])
        next_tokens = next_tokens.scatter(1, last[:, None], at_last[:, None])
        return (token, *self.drafter.extend(out, next_tokens, prefix, last, table, self.drafter.rope(angles_at),
                                            slots, mask))

    @torch.no_grad()
    def _decode(self, requests: list[Request], after: DecodeStep | None = None) -> DecodeStep | None:
        """Queues one decode step for B requests, run on B' >= B rows (with CUDA graphs the batch is padded to its
        bucket; padding rows have empty prefixes and write only the scratch block). Its inputs come from the
        requests, or `after` the step before, on the device, whose tokens the host has not read yet. Returns the
        step while its device work runs (`_overlaps`), else None, its tokens handed out."""
        device, B = self.device, len(requests)
        shape = self._setting(requests)
        depth = shape.num_steps if shape else 0  # the tree's depth: the longest path it can accept
        pad = batch_bucket(B) - B if self.graphs.enabled else 0
        if after is None:
            n, roots = to_device(torch.tensor([[r.cached for r in requests] + [0] * pad,  # [B'] each, in one copy
                                               [r.last_token for r in requests] + [0] * pad]), device)
            draft = None if shape is None else (torch.stack([r.draft.hidden for r in requests]),  # [B, H]
                                                torch.stack([r.draft.logits for r in requests]))  # [B, Vd]
        else:  # padding rows stay at an empty prefix; the roots are copied, as the graph that wrote them runs again
            n = torch.where(torch.arange(B + pad, device=device) < B, after.n + after.num_accepted + 1, 0)
            roots, draft = after.bonus.clone(), after.draft
        table = self._block_table(requests, pad)
        with self.releasing_late(shape is not None):
            with self._phase("draft"):
                if shape is not None:
                    tree = self.drafter.draft_tree(shape, roots, *draft, n, table)
                else:  # plain decoding: the draft falls behind (`_catch_up_drafts`)
                    tree = root_only(roots)
            with self._phase("verify"):  # target pass and verification in one graph
                sampling = self._sampling(requests, pad)
                out, accepted, num_accepted, bonus = self._target_pass(tree, n, table, depth, sampling)
            with self._phase("accept"):
                step = self._accept(requests, shape, depth, tree, n, table, out, accepted, num_accepted, bonus)
                if self._overlaps():
                    return step
                self._finish_decode(step)  # in the phase: profiled steps time it there
        return None

    def _overlaps(self) -> bool:
        """Whether a decode step stays in flight: with overlap on and no profiling (which times each step whole)."""
        return self.config.overlap and not self.profile

    def _sampling(self, requests: list[Request], pad: int, drawing: list[int] | None = None
                  ) -> tuple[SamplingRows, Tensor] | None:
        """None when every request that draws (`drawing`, indices; None: all) is greedy; else the B' rows' sampling
        parameters and seeds [B'] (padding rows sample at temperature 1 with seed 0: they accept paths, which write
        only the scratch block, and nothing of them reaches the host)."""
        drawing = list(range(len(requests))) if drawing is None else drawing
        if all(requests[b].params.greedy for b in drawing):
            return None
        rows = SamplingRows.of([r.params for r in requests] + [SamplingParams()] * pad, len(requests) + pad,
                               self.target.config.vocab_size, self.device)
        return rows, to_device(torch.tensor([r.seed for r in requests] + [0] * pad), self.device)

    def _verification(self, depth: int, sampling: tuple[SamplingRows, Tensor] | None):
        """The verification a graph runs on trees `depth` deep: greedy, or by `sampling` (`_sampling`). -> its name,
        its function of (tokens, parents, logits, node_valid, positions, *inputs) and those inputs. The logits come
        in the target's dtype: the greedy argmax reads them as they are (exact), and so does the sampled walk, whose
        softmax computes in float32 a group of requests at a time (`sampling.draw`), not on a float32 copy of all."""
        if sampling is None:
            return f"greedy verification {depth}", functools.partial(self._verify_greedy, depth), ()
        rows, seeds = sampling
        flags = (rows.any_top_k, rows.any_top_p, rows.any_greedy)
        return (f"sampled verification {depth}, top-k, top-p, greedy rows {flags}",
                functools.partial(self._verify_sampled, flags, depth), (rows.values, seeds))

    def _target_pass(self, tree: DraftTree, n: Tensor, table: Tensor, depth: int,
                     sampling: tuple[SamplingRows, Tensor] | None):
        """One target pass over every tree node (node j's KV goes to position n + j; each node sees the prefix
        and its ancestors) and, in the same graph, the verification of trees `depth` deep: greedy, or by `sampling`
        (`_sampling`). -> (its output, accepted, num_accepted, bonus)."""
        name, verify, verify_inputs = self._verification(depth, sampling)
        aux_layers = self.aux_layers if depth else ()  # a plain step extends no draft: the head's inputs go unread
        inputs = (tree.tokens, tree.parents, tree.depth, table, n, tree.mask, *verify_inputs)
        hidden, aux, *verified = self.graphs(f"target, {name}",
                                             functools.partial(self._target_forward, verify, aux_layers), *inputs)
        return (TargetOutput(hidden=hidden, aux=aux if aux_layers else None), *verified)

    def _target_forward(self, verify, aux_layers: tuple[int, ...], tokens: Tensor, parents: Tensor, depth: Tensor,
                        table: Tensor, prefix: Tensor, mask: Tensor, *verify_inputs: Tensor):
        positions = prefix[:, None] + depth  # node j's: n + its depth
        out = self.target(tokens, self.rope(positions), self.attention(self.pool, table, prefix, mask),
                          aux_layers=aux_layers)
        logits = self.target.logits(out.hidden)  # [B, N, V] in the target's dtype (`_verification`)
        aux = out.aux if out.aux is not None else out.hidden  # graphs return tensors only; ignored without aux layers
        return (out.hidden, aux) + verify(tokens, parents, logits, torch.ones_like(tokens, dtype=torch.bool),
                                          positions, *verify_inputs)

    def _verify_greedy(self, depth: int, tokens: Tensor, parents: Tensor, logits: Tensor, node_valid: Tensor,
                       positions: Tensor) -> tuple[Tensor, ...]:
        """`verify_greedy`, which draws nothing at the nodes' positions. Its argmax of bf16 logits is the argmax of
        their float32 copy (each value exact there, ties alike), without a 48-node tree's 37 MB cast of a 128k
        vocabulary's logits."""
        return self.verify_greedy(tokens, parents, logits, node_valid, depth)

    def _verify_sampled(self, flags: tuple[bool, bool, bool], depth: int, tokens: Tensor, parents: Tensor,
                        logits: Tensor, node_valid: Tensor, positions: Tensor, values: Tensor, seeds: Tensor
                        ) -> tuple[Tensor, ...]:
        """`walk_sampling` on graph inputs: the rows' parameter tensor and `flags` stand for their `SamplingRows`;
        each row draws with its seed at the nodes' positions."""
        return walk_sampling(tokens, parents, logits, node_valid, SamplingRows(values, *flags), seeds,
                             positions, depth, self.follow_targets, self.probs_kernels)

    def _accept(
        self, requests: list[Request], shape: TreeShape | None, depth: int, tree: DraftTree, n: Tensor,
        table: Tensor, out: TargetOutput, accepted: Tensor, num_accepted: Tensor, bonus: Tensor,
    ) -> DecodeStep:
        """Keeps the accepted path's KV, extends the draft along it (after a drafted tree), and queues the copy of the
        tokens to the host. Tensors cover the B' rows, padding included."""
        B = len(requests)
        draft = None
        if shape is not None:
            # A fixed length, the deepest path the tree can accept: graphs need one, and reading the accepted lengths
            # would wait for the step.
            T = min(depth + 1, tree.tokens.shape[1])
            inputs = (accepted, num_accepted, bonus, tree.tokens, out.hidden, n, table) + (
                (out.aux,) if out.aux is not None else ())
            hidden, logits = self.graphs(f"accept, path {T}", functools.partial(self._follow_path, T), *inputs)
            if shape.topk > 1:  # a chain's accepted path is its first nodes, already in place
                # Eager, after the graph: a move is not idempotent, and a graph's first call runs thrice.
                self.accept_kernels.move_path(self.pool, accepted, num_accepted, n, table, T)
            if self.graphs.capture:  # graph outputs are overwritten by the next replay
                hidden, logits = hidden.clone(), logits.clone()
            draft = (hidden, logits)
        # One copy to the host: per request [num_accepted, bonus, accepted path (N), tree tokens (N)].
        host = torch.cat([num_accepted[:B, None], bonus[:B, None], accepted[:B], tree.tokens[:B]], dim=1)
        ready = None
        if host.is_cuda:  # queued behind the step's work, into pinned memory; `ready` marks its arrival
            host, ready = host.to("cpu", non_blocking=True), torch.cuda.Event()
            ready.record()
        return DecodeStep(requests, 1 + depth, n, num_accepted, bonus, draft, host, ready)

    def _finish_decode(self, step: DecodeStep) -> None:
        """Waits for `step`'s tokens and hands them out to its requests that still run."""
        if step.ready is not None:
            step.ready.synchronize()
        host, N = step.host.tolist(), (step.host.shape[1] - 2) // 2
        states = draft_states(*step.draft) if step.draft is not None else None
        for b, request in enumerate(step.requests):
            if request.finished:  # aborted while the step ran, or ended by the step before
                continue
            m, bonus_token, path_host, tokens_host = host[b][0], host[b][1], host[b][2 : 2 + N], host[b][2 + N :]
            request.cached += m + 1
            if states is not None:  # it verified a drafted tree, and the draft followed the accepted path
                request.draft, request.drafted = states[b], request.cached
                request.accepted.append(m)
            self._emit(request, [tokens_host[j] for j in path_host[1 : m + 1]] + [bonus_token])

    def _follow_path(self, T: int, path: Tensor, num_accepted: Tensor, bonus: Tensor, tokens: Tensor, hidden: Tensor,
                     n: Tensor, table: Tensor, aux: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The draft extended along the accepted path's first T nodes (columns past num_accepted are padding), one
        CUDA graph per (bucket, T). path [B', N] node indices (accepted, then -1); num_accepted, bonus, n [B'];
        tokens [B', N]; hidden [B', N, H] and aux [B', N, 3·H] the target pass's. Padding rows' tables hold only
        the scratch block, so whatever they accept is written there. -> the draft's hidden [B', H] and logits
        [B', Vd] at each row's last accepted node."""
        along = self.accept_kernels.path_inputs(path, num_accepted, bonus, tokens, hidden, aux, n, table,
                                                self.pool.block_size, T)
        return self.drafter.extend(along.states, along.next_tokens, n, num_accepted, table,
                                   self.drafter.rope(along.positions), along.slots, _causal_mask(T, path.device))

    def _emit(self, request: Request, tokens: list[int]) -> None:
        """Appends generated tokens, stopping at a stop id, max_new_tokens or the context's end."""
        for token in tokens:
            request.output.append(token)
            if token in request.stop_ids:
                return self._finish(request, "stop")
            if len(request.output) >= request.max_new_tokens:
                return self._finish(request, "length")
        if request.cached + self.reserve + 1 > self.context_limit:
            self._finish(request, "length")

    def _auto_blocks(self, head: DraftHead | None, dtype: torch.dtype) -> int:
        tcfg = self.target.config
        per_token = 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * tcfg.head_dim
        if head is not None:
            per_token += 2 * head.kv_layers * head.config.num_key_value_heads * head.config.head_dim
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free * self.config.mem_fraction) // (per_token * dtype.itemsize)
        else:
            tokens = self.config.cpu_kv_tokens
        return max(tokens // self.config.block_size, 1)


def blocks_to_admit(need: int, batch: int) -> int:
    """The free blocks that admit `batch` requests of `need` blocks each together: the i-th (from 0) is admitted beside
    i running requests only with a block to spare for each (`Engine._admissible`)."""
    return batch * need + batch - 1


def step_reserve(trees: list[TreeShape]) -> int:
    """Positions a decode step may write beyond the cached ones: the largest tree (or the root), or the draft's
    scratch, and one more."""
    return 1 + max([1] + [max(t.num_draft_tokens, t.scratch) for t in trees])


@functools.cache
def _causal_mask(T: int, device: torch.device) -> Tensor:
    """The causal mask of T tokens, built once (in a graph, building it is two launches a replay): an accepted path's
    (T at most a configured tree's depth + 1) or a prefill chunk's (T a `length_bucket`, or a chunk run eagerly), so
    there are few."""
    return causal_mask(T, device)
