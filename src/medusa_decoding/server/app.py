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
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..kernels.attention import EXACT_ATTENTION_NAME
from ..config import MAX_LOGPROBS, CompileMode, GenerationConfig, MedusaError, SamplingConfig
from ..engine import GenerationStats, MedusaModel, Request
from ..text import TextDecoder
from .protocol import (COMPLETION_DEFAULT_MAX_TOKENS, COMPLETION_MAX_LOGPROBS, FIELDS, APIError, ChatBody,
                       CompletionBody, _Body, check_fields, check_unicode, content_text, grammar_of,
                       shutting_down)
from .metrics import Metrics
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
    logprobs: bool  # the answer carries each token's log-probability
    token_ids: bool  # the answer carries its tokens' ids (return_token_ids)


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
        self.metrics = Metrics(queued=lambda: self.scheduler.queue.qsize(), active=lambda: self.scheduler.active)
        self.scheduler.metrics = self.metrics
        self.ctx, self.max_batch_size = decoder.ctx, max_batch_size
        log.info("serving %s: %s, up to %d sequences at once%s", self.name, self.method.describe(),
                 decoder.max_batch_size, ", speculation adapted to load" if policy else "")

    def health(self) -> dict:
        model = self.model
        return {"status": "ok", "model": self.name, "method": self.method.describe(),
                "dtype": str(model.base.dtype).removeprefix("torch."),
                "exact": model.base.config._attn_implementation == EXACT_ATTENTION_NAME,
                "numerics": model.backend.numerics.value,
                "active": self.scheduler.active, "queued": self.scheduler.queue.qsize(),
                "max_batch_size": self.max_batch_size, "rss_mib": resident_mib()}

    def models(self) -> dict:
        return {"object": "list",
                "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "medusa-decoding"}]}

    def check_model(self, body: _Body) -> None:
        """The body's strings are valid Unicode, the model exists, and every field is one this server
        honours (protocol.check_fields)."""
        check_unicode(body.model_dump())
        if body.model != self.name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")
        check_fields(body)

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
        logprobs = self.logprobs(body)
        try:
            sampling = SamplingConfig(
                temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                seed=body.seed, frequency_penalty=body.frequency_penalty or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=self.logit_bias(body))
            grammar = grammar_of(body)
            generation = GenerationConfig(max_new_tokens=max_tokens, stop=stop, logprobs=logprobs, grammar=grammar)
            if grammar is not None:
                self.model.grammars.row(grammar)  # an invalid one is a 400 now, not an error event mid-stream
        except MedusaError as e:
            param = next((p for p in ("top_p", "top_k", "stop", "frequency_penalty", "presence_penalty",
                                      "repetition_penalty", "logit_bias") if p in str(e)), None)
            if "grammar" in str(e):
                param = "response_format" if getattr(body, "response_format", None) else "structured_outputs"
            raise APIError(400, str(e), param=param) from None
        request = Request(input_ids[0].cpu(), generation, sampling, id=uuid.uuid4().hex,
                          speculative=body.speculative)
        who = body.user or getattr(body, "safety_identifier", None)
        if who:
            log.info("request %s from user %r", request.id, who)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _Prepared(Job(request), stop, prompt_tokens, body.stream, include_usage, logprobs is not None,
                         body.return_token_ids)

    @staticmethod
    def logprobs(body: _Body) -> int | None:
        """How many alternatives per token the request asks for (None: no logprobs)."""
        if isinstance(body, CompletionBody):
            if body.logprobs is not None and not 0 <= body.logprobs <= COMPLETION_MAX_LOGPROBS:
                raise APIError(400, f"logprobs must be between 0 and {COMPLETION_MAX_LOGPROBS}, got {body.logprobs}",
                               param="logprobs")
            return body.logprobs
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}",
                           param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None

    def logit_bias(self, body: _Body) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} -> {id: bias}, every id in the vocabulary."""
        if not body.logit_bias:
            return None
        vocab = self.model.base.config.get_text_config().vocab_size
        out = {}
        for key, value in body.logit_bias.items():
            if not (key.strip().isdigit() and 0 <= int(key) < vocab):
                raise APIError(400, f"logit_bias keys must be token ids in 0..{vocab - 1}, got {key!r}",
                               param="logit_bias")
            out[int(key)] = value
        return out

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
        logprobs = self.logprob_block(prepared, text.pieces(), kind, 0)
        choice = ({"index": 0, "text": result["text"], "logprobs": logprobs, "finish_reason": result["finish_reason"]}
                  if kind == "text_completion" else
                  {"index": 0, "message": {"role": "assistant", "content": result["text"]}, "logprobs": logprobs,
                   "finish_reason": result["finish_reason"]})
        if prepared.token_ids:
            choice["token_ids"] = list(text.token_ids)
        return {**meta, "object": kind, "choices": [choice], "usage": result["usage"], "medusa": result["medusa"]}

    def logprob_block(self, prepared: _Prepared, pieces: list[tuple[int, str]], kind: str, offset: int) -> dict | None:
        """The `logprobs` of a choice (or a streamed chunk) for these tokens (index, text): OpenAI's
        chat form {content: [{token, logprob, bytes, top_logprobs}]} or its completions form {tokens,
        token_logprobs, top_logprobs, text_offset} (offset: where the first piece's text starts).
        None where the request did not ask."""
        if not prepared.logprobs:
            return None
        job, decode = prepared.job, self.model.tokenizer.decode
        entries = [(piece, *job.logprobs[i]) for i, piece in pieces]
        if kind == "text_completion":
            starts = [offset + sum(len(p) for p, _, _ in entries[:k]) for k in range(len(entries))]
            return {"tokens": [p for p, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                    "top_logprobs": [{decode([t]): v for t, v in top} for _, _, top in entries], "text_offset": starts}

        def one(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        return {"content": [one(p, lp) | {"top_logprobs": [one(decode([t]), v) for t, v in top]}
                            for p, lp, top in entries], "refusal": None}

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
                       "tree_nodes": round(stats.nodes / max(stats.steps, 1), 2), "accepted_by": dict(stats.accepted_by),
                       "method": self.method.describe() if job.request.speculative else "plain",
                       "tokens_per_s": round(stats.tokens_per_s, 2), "prefill_s": round(stats.prefill_s, 4),
                       "decode_s": round(stats.decode_s, 4)},
        }

    async def stream_events(self, prepared: _Prepared, meta: dict, kind: str) -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

        def event(choice: dict | None, **extra) -> str:
            return f"data: {json.dumps({**meta, 'object': chunk_kind, 'choices': [choice] if choice else [], **extra})}\n\n"

        def choice(delta: str | None, pieces: list[tuple[int, str]], finish: str | None = None,
                   role: bool = False) -> dict:
            logprobs = self.logprob_block(prepared, pieces, kind, sent) if pieces else None
            ids = {"token_ids": [text.token_ids[i] for i, _ in pieces]} if prepared.token_ids else {}
            if kind == "text_completion":
                return {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish} | ids
            d = ({"role": "assistant", "content": ""} if role else {}) | ({"content": delta} if delta else {})
            return {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish} | ids

        def provenance(pieces: list[tuple[int, str]]) -> list[dict]:
            """These tokens (index, text): text, step, depth, source."""
            steps = prepared.job.provenance
            return [{"text": piece, "step": steps[i][0], "depth": steps[i][1], "source": steps[i][2].value}
                    for i, piece in pieces]

        text = TextDecoder(self.model.tokenizer, prepared.stop)
        sent = 0  # characters of the text whose tokens' logprobs were sent
        try:
            if kind == "chat.completion":
                yield event(choice(None, [], role=True))
            try:
                async for delta in deltas(prepared.job, text):
                    pieces = text.pieces()  # the tokens whose text was sent with this delta
                    yield event(choice(delta, pieces), medusa={"tokens": provenance(pieces)})
                    sent += sum(len(p) for _, p in pieces)
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if prepared.job.finish_reason is None:  # cancelled by the server: say so, no [DONE]
                yield f"data: {json.dumps(shutting_down().body())}\n\n"
                return
            result = self.text_result(prepared, text, text.text)
            pieces = text.pieces()
            yield event(choice(None, pieces, finish=result["finish_reason"]),
                        medusa=result["medusa"] | {"tokens": provenance(pieces)})
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
    app.add_middleware(CountAnswers, metrics=service.metrics)
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

    @app.get("/metrics")
    async def metrics():
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

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


class CountAnswers:
    """ASGI middleware counting answers by route and status (metrics.Metrics.answered). Plain ASGI,
    not BaseHTTPMiddleware, which would hide a client's disconnect from the routes."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")  # set by the router on the shared scope
            self.metrics.answered(getattr(route, "path", "other"), status if status is not None else "none")


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
    """Serve `model` with uvicorn until interrupted. A server lives long: in compile mode auto, a
    child process builds the graphs its steps lack while it is idle (it ends with the server)."""
    backend = model.backend
    if getattr(backend, "mode", None) is CompileMode.AUTO:
        backend.background = True
    app = create_app(model, max_batch_size=max_batch_size, **app_kwargs)
    try:
        make_server(app, host, port, log_level).run()
    finally:
        if backend.compiled:
            backend.stop_builder()
