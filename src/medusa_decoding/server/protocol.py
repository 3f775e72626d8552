"""The OpenAI-compatible HTTP protocol: request bodies, errors in OpenAI's format.

Request bodies ignore unknown fields (OpenAI clients send many); every error is answered as
{"error": {message, type, param, code}} with a 4xx status (5xx only for server faults).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

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
    speculative: bool = True  # extension: False decodes this request plainly (a side-by-side baseline)


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


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
