"""The OpenAI-compatible HTTP protocol: request bodies, errors in OpenAI's format.

Nothing in a request is silently ignored. Every field of OpenAI's chat and completions requests
is declared here: honoured (as OpenAI documents it, or in vLLM's sense for its extensions), or
refused with a 400 that names it where it asks for what this server does not do (`REFUSED`: tools,
n > 1, ...; the default or null value of such a field is accepted, as it asks
for nothing). A field OpenAI does not define, and this server does not add, is refused as unknown.
Every error is answered as {"error": {message, type, param, code}} with a 4xx status (5xx only
for server faults).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..config import MAX_LOGPROBS, Grammar, GrammarKind

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the context left
COMPLETION_MAX_LOGPROBS = 5  # OpenAI's limit of /v1/completions' logprobs


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to be refused by name (check_fields)

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
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (as vLLM): > 1 discourages prompt and output tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # an end-user id: written to the server's log with the request
    speculative: bool = True  # extension: False decodes this request plainly (a side-by-side baseline)
    # extension (as vLLM): each choice carries `token_ids`, the ids of its text's tokens (streamed: each chunk's)
    return_token_ids: bool = False
    # extension (as vLLM): one of {"json": schema, "json_object": true, "regex": r, "grammar": lark, "choice": [..]}
    structured_outputs: dict[str, Any] | None = None
    # OpenAI fields this server refuses unless they ask for nothing (REFUSED)
    service_tier: Any = None
    store: Any = None
    metadata: Any = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None  # the likeliest alternatives per token, 0..5 (0: the token's own)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: Any = None
    refusal: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20, with logprobs
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: str | None = None  # as `user`: written to the server's log


def _absent(v) -> bool:
    return v is None


# field -> (is this value one that asks for nothing this server lacks?, what is not built)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: v is None or v == [], "tool calling is not built"),
    "tool_choice": (lambda v: v is None or v == "none", "tool calling is not built (only \"none\")"),
    "parallel_tool_calls": (_absent, "tool calling is not built"),
    "functions": (lambda v: v is None or v == [], "function calling is not built"),
    "function_call": (lambda v: v is None or v == "none", "function calling is not built (only \"none\")"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is served"),
    "audio": (_absent, "only text output is served"),
    "prediction": (_absent, "predicted outputs are not built"),
    "reasoning_effort": (_absent, "the served model does not reason"),
    "web_search_options": (_absent, "web search is not built"),
    "verbosity": (_absent, "the served model has no verbosity setting"),
    "prompt_cache_key": (_absent, "prompt caching is not built"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "one service tier is served"),
    "store": (lambda v: v in (None, False), "completions are not stored"),
    "metadata": (_absent, "completions are not stored, so they carry no metadata"),
    "best_of": (lambda v: v in (None, 1), "one choice per request (best_of 1)"),
    "echo": (lambda v: v in (None, False), "echo is not built"),
    "suffix": (lambda v: v in (None, ""), "insertion (suffix) is not built"),
}
MESSAGE_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (_absent, "participant names are not rendered by the chat template"),
    "tool_calls": (lambda v: v is None or v == [], "tool calling is not built"),
    "tool_call_id": (_absent, "tool calling is not built"),
    "function_call": (_absent, "function calling is not built"),
    "audio": (_absent, "only text is served"),
    "refusal": (_absent, "assistant refusals are not rendered by the chat template"),
}


def check_unicode(value, path: str = "") -> None:
    """Every string (and key) in a request is valid Unicode: JSON may carry a lone surrogate
    (\\ud800), which no tokenizer encodes; a 400 naming where, before anything reads it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path or 'the body'}: not valid Unicode (a lone surrogate)", param=path or None,
                           code="invalid_value") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}.{i}" if path else str(i))


def check_fields(body: _Body) -> None:
    """Refuse, with a 400 naming it, a field this server does not know or does not honour."""
    for name in body.model_extra or {}:
        raise APIError(400, f"unknown field {name!r}: not an OpenAI request field, nor an extension of this server",
                       param=name, code="unsupported_field")
    for name, (fine, why) in REFUSED.items():
        if name in type(body).model_fields and not fine(getattr(body, name)):
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_field")
    for i, message in enumerate(getattr(body, "messages", None) or []):
        for name in message.model_extra or {}:
            raise APIError(400, f"unknown field {name!r} in a message", param=f"messages.{i}.{name}",
                           code="unsupported_field")
        for name, (fine, why) in MESSAGE_REFUSED.items():
            if not fine(getattr(message, name)):
                raise APIError(400, f"messages.{i}.{name}: {why}", param=f"messages.{i}.{name}",
                               code="unsupported_field")
    options = body.stream_options or {}
    if set(options) - {"include_usage"}:
        name = sorted(set(options) - {"include_usage"})[0]
        raise APIError(400, f"stream_options.{name} is not built (only include_usage)", param="stream_options",
                       code="unsupported_field")
    if options and not body.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")


def grammar_of(body: _Body) -> Grammar | None:
    """The request's structured output: chat's `response_format` (text, json_object, json_schema) or
    the `structured_outputs` extension (json, json_object, regex, grammar, choice) -> a Grammar, or
    None for free text; anything else -> a 400 naming it."""
    fmt = getattr(body, "response_format", None)
    grammar = None
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            grammar = Grammar(GrammarKind.JSON_OBJECT)
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema must be an object with a `schema` object",
                               param="response_format")
            grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(spec.get("schema", {})))
        elif kind != "text":
            raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format", code="unsupported_field")
    outputs = body.structured_outputs
    if outputs:
        if grammar is not None:
            raise APIError(400, "give either response_format or structured_outputs", param="structured_outputs")
        if len(outputs) != 1 or next(iter(outputs)) not in STRUCTURED:
            raise APIError(400, f"structured_outputs takes exactly one of {', '.join(STRUCTURED)}, got "
                                f"{', '.join(map(str, outputs)) or 'none'}", param="structured_outputs",
                           code="unsupported_field")
        (key, value), = outputs.items()
        fits, build = STRUCTURED[key]
        if not fits(value):
            raise APIError(400, f"structured_outputs.{key}: not a valid value", param=f"structured_outputs.{key}")
        grammar = build(value)
    return grammar


def _text(v) -> bool:
    return isinstance(v, str) and bool(v)


# the structured_outputs extension (vLLM's names): key -> (is the value one it takes?, its Grammar)
STRUCTURED: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Grammar]]] = {
    "json": (lambda v: isinstance(v, (dict, str)),
             lambda v: Grammar(GrammarKind.JSON_SCHEMA, v if isinstance(v, str) else json.dumps(v))),
    "json_object": (lambda v: v is True, lambda v: Grammar(GrammarKind.JSON_OBJECT)),
    "regex": (_text, lambda v: Grammar(GrammarKind.REGEX, v)),
    "grammar": (_text, lambda v: Grammar(GrammarKind.LARK, v)),
    "choice": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(c, str) for c in v),
               lambda v: Grammar(GrammarKind.REGEX, "|".join(map(re.escape, v)))),
}

FIELDS = set(CompletionBody.model_fields) | set(ChatBody.model_fields) | set(ChatMessage.model_fields)


def content_text(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (only text parts are read)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        texts.append(part["text"])
    return "".join(texts)
