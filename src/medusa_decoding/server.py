"""An OpenAI-compatible HTTP server on top of batched Medusa decoding (batch.py).

    app = create_app(MedusaModel.from_pretrained("smollm2-135m-instruct", heads="shipped"))
    serve(model, host="127.0.0.1", port=8000)        # or: medusa serve

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` gives server-sent events ending with `data: [DONE]`). Every response carries an
extension field `medusa`: steps and mean accepted length (bonus token included).

How it runs: one scheduler task owns the BatchDecoder. Requests queue on an asyncio.Queue;
between two steps the scheduler admits queued requests while the batch has room (each is
prefilled alone), drops cancelled ones, then runs one batched step in a worker thread (the
event loop stays free) and hands every sequence its new tokens through its own queue. Text,
stop strings and the OpenAI formats live in the request handlers. A client that disconnects
cancels its sequence; the slot is free before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batch import BatchDecoder, BatchRequest, SequenceOutput
from .config import DEFAULT_TREE, GenerationConfig, MedusaError, SamplingConfig
from .decode import GenerationStats, context_length
from .engine import MedusaModel
from .tree import TreeBuffers, build_tree

log = logging.getLogger("medusa_decoding.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the context left


class APIError(Exception):
    """An error answered in OpenAI's body format {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shutting_down() -> APIError:
    return APIError(503, "the request was cancelled: the server is shutting down", type="server_error",
                    code="shutting_down")


# --- request bodies (unknown fields are ignored, as OpenAI clients send many) -------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # extension (as vLLM): 0 keeps the whole vocabulary
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


_FIELDS = set(CompletionBody.model_fields) | set(ChatBody.model_fields) | set(ChatMessage.model_fields)


# --- text: token chunks -> text deltas, with stop strings ---------------------------------

class StopText:
    """Token chunks in, text deltas out; engine.TextStream's rules, fed by push: text is held
    back while it may be the start of a stop string or an incomplete UTF-8 character, and
    nothing at or after a stop string is ever sent."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False  # a stop string was found

    def push(self, tokens: list[int]) -> str:
        """Add a chunk; the text that is safe to send now."""
        for token in tokens:  # token by token, so no token past a stop string is kept
            self.token_ids.append(token)
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
            self.text = text[: min(cuts)] if cuts else text
            if cuts:
                self.stopped = True
                return self.flush()
        safe = len(self.text) - self.hold
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return self._send(safe)

    def flush(self) -> str:
        """The rest of the text (at the end of the sequence)."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta


# --- the scheduler ----------------------------------------------------------------------

_CANCELLED = object()  # put on a job's queue when it is cancelled from outside its handler


@dataclass
class Job:
    """One request's sequence: the handler reads SequenceOutputs (or an error) from `out`."""

    request: BatchRequest
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    stats: GenerationStats = field(default_factory=GenerationStats)  # the sequence's, once it ran
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length", once it ended
    watcher: asyncio.Task | None = None  # cancels the job when the client goes away

    @property
    def id(self) -> Hashable:
        return self.request.id


class Scheduler:
    """Owns the BatchDecoder: admits queued jobs, applies cancellations, steps the batch."""

    def __init__(self, decoder: BatchDecoder):
        self.decoder = decoder
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
                outputs = await asyncio.to_thread(self.decoder.step)
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
        self._dispatch([output])

    def _apply_cancels(self) -> None:
        for job_id in self._cancel:
            self.decoder.cancel(job_id)
            self.jobs.pop(job_id, None)
        self._cancel.clear()

    def _dispatch(self, outputs: list[SequenceOutput]) -> None:
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


# --- the app ----------------------------------------------------------------------------

@dataclass
class _Prepared:
    """A validated request, ready to decode."""

    job: Job
    stop: list[str]
    prompt_tokens: int
    stream: bool
    include_usage: bool


def create_app(model: MedusaModel, max_batch_size: int = 8, max_tree_batch: int | None = None,
               model_name: str | None = None, use_medusa: bool = True) -> FastAPI:
    """The FastAPI app serving `model`. max_batch_size: sequences decoded together (more wait in
    the queue); max_tree_batch: above this many active sequences a step verifies the root alone
    (see batch.py); use_medusa False: plain batched decoding."""
    name = model_name or model.name or "medusa"
    heads = model.heads if use_medusa else None
    tree = model.tree
    if heads is not None and not isinstance(tree, TreeBuffers):
        # a dynamic tree differs per row; batched decoding runs one static tree for all rows
        tree = build_tree([p for p in DEFAULT_TREE if len(p) <= heads.num_heads])
        log.warning("the server runs the default static tree (a dynamic tree is not batched)")
    if heads is not None and tree.ngram_length:
        tree = build_tree(tree.paths)
    decoder = BatchDecoder(model.base, heads, tree, model.eos_token_ids, max_batch_size, max_tree_batch)
    scheduler = Scheduler(decoder)
    ctx = context_length(model.base)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(scheduler.run())
        try:
            yield
        finally:
            scheduler.close()
            try:  # the step in progress ends, then run() returns
                await asyncio.wait_for(task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()

    app = FastAPI(title="medusa-decoding", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.model_name = name

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            error = APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
        elif tuple(err.get("loc", ())) == ("body",):
            error = APIError(400, "the request body must be a JSON object with the request's fields")
        else:
            # the field's path, e.g. messages.0.role; a union adds its members' names: dropped
            param = ".".join(str(p) for p in err["loc"][1:] if isinstance(p, int) or p in _FIELDS) or None
            error = APIError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param, code="invalid_value")
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), code=None).body(), status_code=e.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "active": scheduler.active, "queued": scheduler.queue.qsize(),
                "max_batch_size": max_batch_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "medusa-decoding"}]}

    def prepare(body: _Body, input_ids: torch.Tensor, max_tokens: int | None, default_max: int | None) -> _Prepared:
        """Validate the shared parameters and build the job."""
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
        prompt_tokens = input_ids.shape[-1]
        if prompt_tokens >= ctx:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; the model's context is {ctx} tokens, "
                                "leave room to generate", param="messages" if isinstance(body, ChatBody) else "prompt",
                           code="context_length_exceeded")
        room = ctx - prompt_tokens
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif not 1 <= max_tokens <= room:
            raise APIError(400, f"max_tokens must be between 1 and {room} (context {ctx} minus the prompt's "
                                f"{prompt_tokens} tokens), got {max_tokens}", param="max_tokens",
                           code="context_length_exceeded" if max_tokens > room else "invalid_value")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be between 0 and 2, got {temperature}", param="temperature")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            sampling = SamplingConfig(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                      top_k=body.top_k or 0, seed=body.seed)
            generation = GenerationConfig(max_new_tokens=max_tokens, stop=stop)
        except MedusaError as e:
            param = next((p for p in ("top_p", "top_k", "stop") if p in str(e)), None)
            raise APIError(400, str(e), param=param) from None
        request = BatchRequest(input_ids[0].cpu(), generation, sampling, id=uuid.uuid4().hex)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _Prepared(Job(request), stop, prompt_tokens, body.stream, include_usage)

    def check_model(body: _Body) -> None:
        if body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")

    def encode(prompt, chat: bool, param: str) -> torch.Tensor:
        try:
            return model.encode(prompt, chat=chat)  # [1, T]
        except MedusaError as e:
            raise APIError(400, str(e), param=param) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if not all(0 <= t < model.base.config.get_text_config().vocab_size for t in prompt):
                raise APIError(400, "prompt token ids must be in the vocabulary", param="prompt")
            input_ids = torch.tensor([prompt])
        else:
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise APIError(400, f"prompt must be one string (one choice per request), got {len(prompt)}",
                                   param="prompt")
                prompt = prompt[0]
            input_ids = encode(prompt, False, "prompt")
        prepared = prepare(body, input_ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        return await respond(prepared, request, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body)
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        messages = [{"role": m.role, "content": _content_text(m.content)} for m in body.messages]
        input_ids = encode(messages, True, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = prepare(body, input_ids, max_tokens, None)
        return await respond(prepared, request, "chat.completion", "chatcmpl")

    async def respond(prepared: _Prepared, request: Request, kind: str, prefix: str):
        job = prepared.job
        scheduler.submit(job)
        # the watcher also covers a stream whose client leaves before its generator starts
        job.watcher = asyncio.create_task(_watch_disconnect(request, scheduler, job))
        meta = {"id": f"{prefix}-{job.id}", "created": int(time.time()), "model": name}
        if prepared.stream:
            return StreamingResponse(stream_events(prepared, meta, kind), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text = StopText(model.tokenizer, prepared.stop)
            parts = [delta async for delta in _deltas(job, text)]
        finally:
            scheduler.cancel(job)  # a no-op once it finished; frees the slot otherwise
        if job.finish_reason is None:  # cancelled from outside: shutdown or a gone client
            raise shutting_down()
        result = text_result(prepared, text, "".join(parts))
        choice = ({"index": 0, "text": result["text"], "logprobs": None, "finish_reason": result["finish_reason"]}
                  if kind == "text_completion" else
                  {"index": 0, "message": {"role": "assistant", "content": result["text"]}, "logprobs": None,
                   "finish_reason": result["finish_reason"]})
        return {**meta, "object": kind, "choices": [choice], "usage": result["usage"], "medusa": result["medusa"]}

    def text_result(prepared: _Prepared, text: StopText, full: str) -> dict:
        job = prepared.job
        stats: GenerationStats = job.stats
        completion = len(text.token_ids)
        return {
            "text": full,
            "finish_reason": "stop" if text.stopped else job.finish_reason,
            "usage": {"prompt_tokens": prepared.prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prepared.prompt_tokens + completion},
            "medusa": {"steps": stats.steps, "mean_accepted_length": round(stats.mean_accepted_length, 4),
                       "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth],
                       "tree_nodes": decoder.tree.num_nodes},
        }

    async def stream_events(prepared: _Prepared, meta: dict, kind: str) -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

        def event(choice: dict | None, **extra) -> str:
            return f"data: {json.dumps({**meta, 'object': chunk_kind, 'choices': [choice] if choice else [], **extra})}\n\n"

        def choice(delta: str | None, finish: str | None = None, role: bool = False) -> dict:
            if kind == "text_completion":
                return {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            d = ({"role": "assistant", "content": ""} if role else {}) | ({"content": delta} if delta else {})
            return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}

        text = StopText(model.tokenizer, prepared.stop)
        try:
            if kind == "chat.completion":
                yield event(choice(None, role=True))
            try:
                async for delta in _deltas(prepared.job, text):
                    yield event(choice(delta))
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if prepared.job.finish_reason is None:  # cancelled by the server: say so, no [DONE]
                yield f"data: {json.dumps(shutting_down().body())}\n\n"
                return
            result = text_result(prepared, text, text.text)
            yield event(choice(None, finish=result["finish_reason"]), medusa=result["medusa"])
            if prepared.include_usage:
                yield event(None, usage=result["usage"])
            yield "data: [DONE]\n\n"
        finally:  # also on a client disconnect, which cancels this generator
            scheduler.cancel(prepared.job)

    return app


def _content_text(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (only text parts are read)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        texts.append(part["text"])
    return "".join(texts)


async def _deltas(job: Job, text: StopText) -> AsyncIterator[str]:
    """The job's text deltas until it finishes, hits a stop string or is cancelled. Records
    job.stats and job.finish_reason ("stop" for EOS, "length" otherwise) as it goes."""
    while True:
        item = await job.out.get()
        if item is _CANCELLED:
            return
        if isinstance(item, BaseException):
            raise item
        job.stats = item.stats
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


async def _watch_disconnect(request: Request, scheduler: Scheduler, job: Job, every_s: float = 0.05) -> None:
    """Cancel `job` when the client of a non-streaming request goes away."""
    while not job.cancelled:
        if await request.is_disconnected():
            scheduler.cancel(job)
            return
        await asyncio.sleep(every_s)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                graceful_timeout_s: float = 5.0):
    """A uvicorn server for an app of create_app. On shutdown (Ctrl-C, SIGTERM, should_exit) it
    first cancels every queued and running request: each gets a clean end (a 503 error body, or
    an error event that closes its stream), then uvicorn closes the connections."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.state.scheduler.close()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout_s)
    return Server(config)


def serve(model: MedusaModel, host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 8,
          max_tree_batch: int | None = None, log_level: str = "info", **app_kwargs) -> None:
    """Serve `model` with uvicorn until interrupted."""
    app = create_app(model, max_batch_size=max_batch_size, max_tree_batch=max_tree_batch, **app_kwargs)
    make_server(app, host, port, log_level).run()
