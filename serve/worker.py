"""The engine's own thread: the asyncio side submits and aborts requests, the thread steps the engine.

    worker = EngineWorker(engine)     # worker.metrics: what the app's /metrics renders
    worker.start()
    stream = await worker.submit(prompt_ids, SamplingParams(temperature=0), max_new_tokens=64, stop_ids={2})
    while isinstance(event := await stream.events.get(), Tokens):
        ...                           # event.ids: new token ids; event.verified: the verifications so far
    event                             # Finish(reason, accepted, error)
    worker.shutdown()

The engine is not thread-safe, so only this thread touches it (and its requests). Commands arrive through
a `queue.Queue`; token deltas and the finish go back with `loop.call_soon_threadsafe` into each request's
`asyncio.Queue`, after the metrics are updated (so a client that has its answer reads /metrics up to date). An
exception inside `step` ends the requests that were running with reason "error" (their blocks freed) and the
loop goes on. An exception elsewhere ends the thread: every request it holds or has queued ends with an error,
later ones are refused (a 503), and /health says so.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .engine import Engine, Request
from .metrics import Metrics
from .sampling import SamplingParams

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The worker no longer accepts requests."""


@dataclass(frozen=True)
class Tokens:
    ids: list[int]  # new token ids
    verified: int  # the request's verifications so far, these tokens' included (len of its Finish's `accepted` then)


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop", "length", "abort" or "error"
    accepted: list[int]  # per verification, the draft tokens it accepted
    error: str | None = None  # why, for "error" and for an "abort" at the shutdown's deadline


class Stream:
    """The asyncio side of one request: `events` yields `Tokens`, then one `Finish`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: asyncio.Queue[Tokens | Finish] = asyncio.Queue()
        self.request: Request | None = None  # set and read by the worker thread only

    def put(self, event: Tokens | Finish) -> None:  # from the worker thread
        self.call(self.events.put_nowait, event)

    def call(self, fn, *args) -> None:
        """Runs fn(*args) on the submitter's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that loop is closed: nobody listens any more
            pass


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the submitter was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class EngineWorker:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.metrics = Metrics(engine)  # the app's /metrics renders these
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[Request, Stream] = {}
        self._errors: dict[Request, str] = {}
        self._deadline: float | None = None  # set by shutdown: abort what is still running after it
        self._closed = False  # read on the asyncio side, set by `shutdown` and by the thread's failure
        self._closing = threading.Lock()  # a submit either queues before the failed thread drains, or is refused
        self._failure: str | None = None  # why the engine thread ended, if it failed
        self._thread = threading.Thread(target=self._run, name="eyas-engine", daemon=True)

    # ---- asyncio side -----------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (once: later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    async def submit(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int, stop_ids=frozenset()
    ) -> Stream:
        """Queues a request; raises ValueError when the engine rejects it, ShuttingDown after `shutdown`. A submitter
        cancelled while it waits (a client gone) aborts the request: commands run in order, so after its add."""
        loop = asyncio.get_running_loop()
        stream, added = Stream(loop), loop.create_future()
        with self._closing:
            if self._closed:
                raise ShuttingDown(self.unavailable())
            self._inbox.put(("add", stream, (prompt, params, max_new_tokens, stop_ids), added))
        try:
            await added
        except asyncio.CancelledError:
            self.abort(stream)
            raise
        return stream

    def unavailable(self) -> str | None:
        """Why no request can be served now (what /health answers), or None."""
        if self._failure is not None:
            return self._failure
        if self._closed:
            return "the server is shutting down"
        if not self._thread.is_alive():  # not started
            return "the engine thread is not running"
        return None

    def abort(self, stream: Stream, reason: str = "abort") -> None:
        """Ends the request now with `reason` ("stop" for a stop string found in the text); its Finish still
        arrives, with the engine's reason if it had finished already."""
        self._inbox.put(("abort", stream, reason, None))

    def close(self, timeout: float = 30.0) -> None:
        """Stops accepting requests and lets running ones finish for `timeout` seconds; the engine thread then aborts
        the rest (a 503, or a stream's error event) and ends. Returns at once; a second call changes nothing."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(("stop", None, time.monotonic() + timeout, None))

    def shutdown(self, timeout: float = 30.0) -> None:
        """`close`, then waits for the engine thread to end."""
        self.close(timeout)
        self._thread.join()

    # ---- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug outside `step`: nobody may wait for a thread that is gone
            log.exception("the engine thread failed; the server stops serving")
            self._fail_all(f"the engine thread failed: {type(e).__name__}: {e}")

    def _serve(self) -> None:
        engine = self.engine
        if engine.device.type == "cuda":
            torch.cuda.set_device(engine.device)  # per thread; Triton kernels launch on the current device
        while True:
            self._take_commands(block=not engine.has_work() and self._deadline is None)
            if self._deadline is not None:
                if not engine.has_work():
                    self._publish()  # the Finish of a request this last batch of commands aborted
                    break
                if time.monotonic() > self._deadline:
                    for request in list(self._live):  # their clients still wait: the Finish says why
                        self._errors[request] = "the server shut down before the request finished"
                        engine.abort(request)
            if engine.has_work():
                try:
                    engine.step()
                except Exception as e:  # a bad step must not take the server down
                    log.exception("engine step failed; ending the running requests")
                    self._fail_running(f"internal error in the engine: {type(e).__name__}: {e}")
            self._publish()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(block=block)
            while True:
                self._handle(*command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, kind: str, stream: Stream | None, payload, added: asyncio.Future | None) -> None:
        if kind == "add":
            if self._deadline is not None:
                stream.call(_settle, added, ShuttingDown("the server is shutting down"))
                return
            try:
                stream.request = self.engine.add_request(*payload)
            except Exception as e:  # ValueError: the request can never run
                stream.call(_settle, added, e)
                return
            self._live[stream.request] = stream
            self.metrics.prompt_tokens.inc(len(stream.request.prompt))
            stream.call(_settle, added, None)
        elif kind == "abort":
            if stream.request is not None and not stream.request.finished:
                stream.request.finish_reason = payload  # kept by `abort`, which frees the blocks
                self.engine.abort(stream.request)
        elif kind == "stop":
            self._deadline = payload

    def _fail_all(self, message: str) -> None:
        """Ends every request held or queued with `message`, without the engine (whose state is not trusted now)."""
        with self._closing:
            self._failure, self._closed = message, True
        for stream in self._live.values():
            stream.put(Finish("error", [], message))
        while True:
            try:
                kind, stream, _, added = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                stream.call(_settle, added, ShuttingDown(message))

    def _fail_running(self, message: str) -> None:
        for request in list(self.engine.running):
            request.finish_reason = "error"  # kept by `abort`, which frees the blocks
            self._errors[request] = message
            self.engine.abort(request)

    def _publish(self) -> None:
        events: list[tuple[Stream, Tokens | Finish]] = []
        for request, stream in list(self._live.items()):
            new = request.take_new_tokens()
            if new:
                events.append((stream, Tokens(new, len(request.accepted))))
                self.metrics.generation_tokens.inc(len(new))
            if request.finished:
                del self._live[request]
                finish = Finish(request.finish_reason, list(request.accepted), self._errors.pop(request, None))
                events.append((stream, finish))
                self.metrics.observe_finish(finish)
        self.metrics.observe_engine(self.engine)
        for stream, event in events:  # after the metrics: see the module docstring
            stream.put(event)
