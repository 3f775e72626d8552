"""The scheduler: one task owns the decoder (engine.Decoder) and runs continuous batching.

Requests queue on an asyncio.Queue; between two steps the scheduler admits queued requests
while the batch has room (each is prefilled alone), drops cancelled ones, then runs one batched
step in a worker thread (the event loop stays free) and hands every sequence its new tokens
through its own queue. A client that disconnects cancels its sequence; its place is free
before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

from ..config import MedusaError
from ..engine import Decoder, GenerationStats, Request, RowOutput, Source
from ..text import TextDecoder
from .protocol import APIError, shutting_down

log = logging.getLogger("medusa_decoding.server")


_CANCELLED = object()  # put on a job's queue when it is cancelled from outside its handler


@dataclass
class Job:
    """One request's sequence: the handler reads RowOutputs (or an error) from `out`."""

    request: Request
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    stats: GenerationStats = field(default_factory=GenerationStats)  # the sequence's, once it ran
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length", once it ended
    watcher: asyncio.Task | None = None  # cancels the job when the client goes away
    provenance: list[tuple[int, int, Source]] = field(default_factory=list)  # per token: step, depth, source
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per token, where asked

    @property
    def id(self) -> Hashable:
        return self.request.id


class Scheduler:
    """Owns the Decoder: admits queued jobs, applies cancellations, steps the batch."""

    def __init__(self, decoder: Decoder, metrics=None):
        """metrics: what counts prefills and steps (metrics.Metrics; None: nothing)."""
        self.decoder, self.metrics = decoder, metrics
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.jobs: dict[Hashable, Job] = {}  # admitted, not finished
        self._cancel: set[Hashable] = set()
        self._closed = False

    def submit(self, job: Job) -> None:
        if self._closed:
            raise shutting_down()
        self.queue.put_nowait(job)

    def cancel(self, job: Job) -> None:
        """Synchronous, so a handler's `finally` can call it while being cancelled."""
        if job.watcher is not None:
            job.watcher.cancel()
        if not job.cancelled:
            job.cancelled = True
            self._cancel.add(job.id)
            job.out.put_nowait(_CANCELLED)

    @property
    def active(self) -> int:
        return len(self.decoder)

    async def run(self) -> None:
        """Until close(): admit, cancel, step. Only this task touches the decoder, and only
        between steps; a step runs in a worker thread."""
        while not self._closed:
            if not len(self.decoder):  # idle: wait for work (close() wakes it with None)
                await self._admit(await self.queue.get())
            while self.decoder.has_room and not self.queue.empty():
                await self._admit(self.queue.get_nowait())
            self._apply_cancels()
            if not len(self.decoder):
                continue
            try:
                t0 = time.perf_counter()
                outputs = await asyncio.to_thread(self.decoder.step)
                if self.metrics is not None:
                    self.metrics.stepped(outputs, time.perf_counter() - t0)
            except Exception as e:  # a bug, not a user error: fail the batch, keep serving
                log.exception("decoding step failed")
                for job_id in self.decoder.ids:
                    self.decoder.cancel(job_id)
                    job = self.jobs.pop(job_id, None)
                    if job is not None:
                        job.out.put_nowait(APIError(500, f"decoding failed: {e}", type="server_error"))
                continue
            self._dispatch(outputs)
        self._apply_cancels()
        while not self.queue.empty():  # close()'s wake-up call
            self.queue.get_nowait()

    async def _admit(self, job: Job | None) -> None:
        if job is None or job.cancelled or self._closed:
            return
        try:
            output = await asyncio.to_thread(self.decoder.add, job.request)
        except MedusaError as e:
            job.out.put_nowait(APIError(400, str(e)))
            return
        except Exception as e:
            log.exception("prefill failed")
            job.out.put_nowait(APIError(500, f"prefill failed: {e}", type="server_error"))
            return
        self.jobs[job.id] = job
        if self.metrics is not None:
            self.metrics.prefilled(output)
        self._dispatch([output])

    def _apply_cancels(self) -> None:
        for job_id in self._cancel:
            self.decoder.cancel(job_id)
            self.jobs.pop(job_id, None)
        self._cancel.clear()

    def _dispatch(self, outputs: list[RowOutput]) -> None:
        for output in outputs:
            job = self.jobs.get(output.id)
            if job is None:
                continue
            if output.finished:
                del self.jobs[output.id]
            if not job.cancelled:
                job.out.put_nowait(output)

    def close(self) -> None:
        """Cancel every job, queued or running, and make run() return after the step in
        progress (graceful shutdown). Never touches the decoder: a step may be running."""
        if self._closed:
            return
        self._closed = True
        while not self.queue.empty():
            job = self.queue.get_nowait()
            if job is not None:
                self.cancel(job)
        for job in list(self.jobs.values()):
            self.cancel(job)
        self.queue.put_nowait(None)


async def deltas(job: Job, text: TextDecoder) -> AsyncIterator[str]:
    """The job's text deltas until it finishes, hits a stop string or is cancelled. Records
    job.stats and job.finish_reason ("stop" for EOS, "length" otherwise) as it goes."""
    while True:
        item = await job.out.get()
        if item is _CANCELLED:
            return
        if isinstance(item, BaseException):
            raise item
        job.stats = item.stats
        job.provenance += zip([item.step] * len(item.tokens), item.depths, item.sources)
        job.logprobs += item.logprobs or []
        delta = text.push(item.tokens)
        if text.stopped:
            job.finish_reason = "stop"
        elif item.finished:
            job.finish_reason = item.finish_reason
            delta += text.flush()
        if delta:
            yield delta
        if text.stopped or item.finished:
            return


async def watch_disconnect(request, scheduler: Scheduler, job: Job, every_s: float = 0.05) -> None:
    """Cancel `job` when the client of a non-streaming request goes away."""
    while not job.cancelled:
        if await request.is_disconnected():
            scheduler.cancel(job)
            return
        await asyncio.sleep(every_s)
