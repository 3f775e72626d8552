"""The app: FastAPI routes for /health, /v1/models, /v1/completions and /v1/chat/completions
(`stream: true` gives server-sent events ending with `data: [DONE]`), on top of the scheduler,
and a page on `/` (page.html: chat, every token coloured by how it was produced).

    app = create_app(MedusaModel.from_pretrained("smollm2-135m-instruct"))  # what medusa serve runs
    serve(model, host="127.0.0.1", port=8000)        # or: medusa serve

Every method `medusa generate` runs is served, the default included: each row has its own
proposer state. Speculation adapts to load (engine.AdaptiveSpeculation): each step's budget is
the one measured fastest at the current number of active rows, plain decoding included (a tree
must win by more than 5%). Every
response carries an extension field `medusa`: steps and mean accepted length (bonus included);
each streamed chunk's `medusa.tokens` gives every token's text, step, depth and source (README,
"Serving"). A request with `"speculative": false` is decoded plainly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..kernels.attention import EXACT_ATTENTION_NAME
from ..config import GenerationConfig, MedusaError, SamplingConfig
from ..engine import GenerationStats, MedusaModel, Request
from ..text import TextDecoder
from .protocol import (COMPLETION_DEFAULT_MAX_TOKENS, FIELDS, APIError, ChatBody, CompletionBody, _Body, content_text,
                       shutting_down)
from .scheduler import Job, Scheduler, deltas, watch_disconnect

log = logging.getLogger("medusa_decoding.server")


@dataclass
class _Prepared:
    """A validated request, ready to decode."""

    job: Job
    stop: list[str]
    prompt_tokens: int
    stream: bool
    include_usage: bool


class Service:
    """What the routes call: one model's method behind one scheduler (continuous batching)."""

    def __init__(self, model: MedusaModel, max_batch_size: int = 8, model_name: str | None = None,
                 use_medusa: bool = True, adaptive: bool = True):
        self.model = model
        self.name = model_name or model.name or "medusa"
        self.method = model.method(use_medusa)
        policy = self.method.adaptive() if adaptive else None
        decoder = model.decoder(max_batch_size, use_medusa, policy)
        self.scheduler = Scheduler(decoder)
        self.ctx, self.max_batch_size = decoder.ctx, max_batch_size
        log.info("serving %s: %s, up to %d sequences at once%s", self.name, self.method.describe(),
                 decoder.max_batch_size, ", speculation adapted to load" if policy else "")

    def health(self) -> dict:
        model = self.model
        return {"status": "ok", "model": self.name, "method": self.method.describe(),
                "dtype": str(model.base.dtype).removeprefix("torch."),
                "exact": model.base.config._attn_implementation == EXACT_ATTENTION_NAME,
                "active": self.scheduler.active, "queued": self.scheduler.queue.qsize(),
                "max_batch_size": self.max_batch_size, "rss_mib": resident_mib()}

    def models(self) -> dict:
        return {"object": "list",
                "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "medusa-decoding"}]}

    def check_model(self, body: _Body) -> None:
        if body.model != self.name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def encode(self, prompt, chat: bool, param: str) -> torch.Tensor:
        try:
            return self.model.encode(prompt, chat=chat)  # [1, T]
        except MedusaError as e:
            raise APIError(400, str(e), param=param) from None

    def completion_ids(self, body: CompletionBody) -> torch.Tensor:
        """A completion's prompt (text, or token ids) -> input_ids [1, T]."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if not all(0 <= t < self.model.base.config.get_text_config().vocab_size for t in prompt):
                raise APIError(400, "prompt token ids must be in the vocabulary", param="prompt")
            return torch.tensor([prompt])
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, f"prompt must be one string (one choice per request), got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        return self.encode(prompt, False, "prompt")

    def chat_ids(self, body: ChatBody) -> torch.Tensor:
        """A chat's messages, rendered by the model's chat template -> input_ids [1, T]."""
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        messages = [{"role": m.role, "content": content_text(m.content)} for m in body.messages]
        return self.encode(messages, True, "messages")

    def prepare(self, body: _Body, input_ids: torch.Tensor, max_tokens: int | None, default_max: int | None) -> _Prepared:
        """Validate the shared parameters and build the job."""
        ctx = self.ctx
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
        request = Request(input_ids[0].cpu(), generation, sampling, id=uuid.uuid4().hex,
                          speculative=body.speculative)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _Prepared(Job(request), stop, prompt_tokens, body.stream, include_usage)

    async def respond(self, prepared: _Prepared, request: HTTPRequest, kind: str, prefix: str):
        """Submit the job; answer with its whole text, or with a stream of server-sent events."""
        job, scheduler = prepared.job, self.scheduler
        scheduler.submit(job)
        # the watcher also covers a stream whose client leaves before its generator starts
        job.watcher = asyncio.create_task(watch_disconnect(request, scheduler, job))
        meta = {"id": f"{prefix}-{job.id}", "created": int(time.time()), "model": self.name}
        if prepared.stream:
            return StreamingResponse(self.stream_events(prepared, meta, kind), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text = TextDecoder(self.model.tokenizer, prepared.stop)
            parts = [delta async for delta in deltas(job, text)]
        finally:
            scheduler.cancel(job)  # a no-op once it finished; frees the slot otherwise
        if job.finish_reason is None:  # cancelled from outside: shutdown or a gone client
            raise shutting_down()
        result = self.text_result(prepared, text, "".join(parts))
        choice = ({"index": 0, "text": result["text"], "logprobs": None, "finish_reason": result["finish_reason"]}
                  if kind == "text_completion" else
                  {"index": 0, "message": {"role": "assistant", "content": result["text"]}, "logprobs": None,
                   "finish_reason": result["finish_reason"]})
        return {**meta, "object": kind, "choices": [choice], "usage": result["usage"], "medusa": result["medusa"]}

    def text_result(self, prepared: _Prepared, text: TextDecoder, full: str) -> dict:
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
                       "tree_nodes": round(stats.nodes / max(stats.steps, 1), 2), "ngram_accepted": stats.ngram_accepted,
                       "method": self.method.describe() if job.request.speculative else "plain",
                       "tokens_per_s": round(stats.tokens_per_s, 2), "prefill_s": round(stats.prefill_s, 4),
                       "decode_s": round(stats.decode_s, 4)},
        }

    async def stream_events(self, prepared: _Prepared, meta: dict, kind: str) -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

        def event(choice: dict | None, **extra) -> str:
            return f"data: {json.dumps({**meta, 'object': chunk_kind, 'choices': [choice] if choice else [], **extra})}\n\n"

        def choice(delta: str | None, finish: str | None = None, role: bool = False) -> dict:
            if kind == "text_completion":
                return {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            d = ({"role": "assistant", "content": ""} if role else {}) | ({"content": delta} if delta else {})
            return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}

        def provenance() -> list[dict]:
            """The tokens whose text was sent since the last call: text, step, depth, source."""
            steps = prepared.job.provenance
            return [{"text": piece, "step": steps[i][0], "depth": steps[i][1], "source": steps[i][2].value}
                    for i, piece in text.pieces()]

        text = TextDecoder(self.model.tokenizer, prepared.stop)
        try:
            if kind == "chat.completion":
                yield event(choice(None, role=True))
            try:
                async for delta in deltas(prepared.job, text):
                    yield event(choice(delta), medusa={"tokens": provenance()})
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if prepared.job.finish_reason is None:  # cancelled by the server: say so, no [DONE]
                yield f"data: {json.dumps(shutting_down().body())}\n\n"
                return
            result = self.text_result(prepared, text, text.text)
            yield event(choice(None, finish=result["finish_reason"]), medusa=result["medusa"] | {"tokens": provenance()})
            if prepared.include_usage:
                yield event(None, usage=result["usage"])
            yield "data: [DONE]\n\n"
        finally:  # also on a client disconnect, which cancels this generator
            self.scheduler.cancel(prepared.job)


def validation_error(e: RequestValidationError) -> APIError:
    """FastAPI's validation error -> OpenAI's error body, naming the field."""
    err = e.errors()[0] if e.errors() else {}
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    if tuple(err.get("loc", ())) == ("body",):
        return APIError(400, "the request body must be a JSON object with the request's fields")
    # the field's path, e.g. messages.0.role; a union adds its members' names: dropped
    param = ".".join(str(p) for p in err["loc"][1:] if isinstance(p, int) or p in FIELDS) or None
    return APIError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param, code="invalid_value")


def create_app(model: MedusaModel, max_batch_size: int = 8, model_name: str | None = None,
               use_medusa: bool = True, adaptive: bool = True) -> FastAPI:
    """The FastAPI app serving `model`'s method (use_medusa False: plain batched decoding).
    max_batch_size: sequences decoded together (more wait in the queue); adaptive: each step's
    budget chosen from measured throughput at the current number of rows (False: always the
    method's own budget)."""
    service = Service(model, max_batch_size, model_name, use_medusa, adaptive)
    scheduler = service.scheduler

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
    app.state.model_name = service.name
    page = (resources.files(__package__) / "page.html").read_text(encoding="utf-8")

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, e: RequestValidationError):
        return JSONResponse(validation_error(e).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), code=None).body(), status_code=e.status_code)

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.get("/health")
    async def health():
        return service.health()

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest):
        service.check_model(body)
        prepared = service.prepare(body, service.completion_ids(body), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        return await service.respond(prepared, request, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: HTTPRequest):
        service.check_model(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = service.prepare(body, service.chat_ids(body), max_tokens, None)
        return await service.respond(prepared, request, "chat.completion", "chatcmpl")

    return app


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kib / 1024, 1)


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
          log_level: str = "info", **app_kwargs) -> None:
    """Serve `model` with uvicorn until interrupted."""
    app = create_app(model, max_batch_size=max_batch_size, **app_kwargs)
    make_server(app, host, port, log_level).run()
