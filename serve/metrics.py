"""Prometheus metrics of the server, in a registry of their own (one per app, so tests can run several).

    eyas_http_requests_total{endpoint, status}     HTTP responses by endpoint and status code
    eyas_requests_finished_total{reason}           generations by finish: stop, length, abort, error
    eyas_prompt_tokens_total, eyas_generation_tokens_total
    eyas_queue_depth, eyas_running_requests        the engine's waiting and running requests
    eyas_kv_blocks_used, eyas_kv_blocks_free       the paged KV pool
    eyas_preemptions_total                         requests preempted for KV blocks (recomputed on readmission)
    eyas_recomputed_positions_total                the positions of KV those preemptions freed, prefilled again
    eyas_acceptance_length                         tokens per verification step (accepted drafts + 1)
    eyas_verify_steps_total                        verification steps
    eyas_draft_accepted_total{position}            steps that accepted the draft token at depth `position`;
                                                   / eyas_verify_steps_total = per-position acceptance rate
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import Engine


class Metrics:
    def __init__(self, engine: Engine):
        # A verification yields at most the deepest tree's steps plus the bonus token: the top bucket.
        max_accept = 1 + max([0] + [t.num_steps for t in engine.trees])
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("eyas_http_requests", "HTTP responses", ["endpoint", "status"], registry=r)
        self.finished = Counter("eyas_requests_finished", "Finished generations by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("eyas_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("eyas_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("eyas_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("eyas_running_requests", "Requests being generated", registry=r)
        self.kv_used = Gauge("eyas_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge("eyas_kv_blocks_free", "KV cache blocks free", registry=r)
        self.preemptions = Counter("eyas_preemptions", "Requests preempted for KV blocks", registry=r)
        self.recomputed = Counter("eyas_recomputed_positions", "KV positions freed by preemptions", registry=r)
        self._preempted = (0, 0)  # the engine's (preemptions, recomputed) as last counted
        self.acceptance = Histogram("eyas_acceptance_length", "Tokens per verification step", registry=r,
                                    buckets=list(range(1, max_accept + 1)))
        self.verify_steps = Counter("eyas_verify_steps", "Verification steps", registry=r)
        self.accepted_at = Counter("eyas_draft_accepted", "Steps that accepted the draft token at this depth",
                                   ["position"], registry=r)

    def observe_engine(self, engine: Engine) -> None:
        free = engine.pool.allocator.num_free
        self.queue_depth.set(len(engine.waiting))
        self.running.set(len(engine.running))
        self.kv_free.set(free)
        self.kv_used.set(engine.pool.allocator.num_blocks - free)
        self.preemptions.inc(engine.preemptions - self._preempted[0])  # the engine's totals, as counters
        self.recomputed.inc(engine.recomputed - self._preempted[1])
        self._preempted = (engine.preemptions, engine.recomputed)

    def observe_finish(self, finish) -> None:
        """`finish`: a worker.Finish."""
        self.finished.labels(finish.reason).inc()
        self.verify_steps.inc(len(finish.accepted))
        for m in finish.accepted:
            self.acceptance.observe(m + 1)
        for position in range(1, max(finish.accepted, default=0) + 1):  # one counter update per depth
            self.accepted_at.labels(str(position)).inc(sum(m >= position for m in finish.accepted))

    def render(self) -> bytes:
        return generate_latest(self.registry)
