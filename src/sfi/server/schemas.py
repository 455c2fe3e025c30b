"""The OpenAI-compatible request bodies (strict types, fields OpenAI defines but sfi does not
implement refused by name unless neutral) and the error shape every failure answers with:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)


class BudgetOverride(BaseModel):
    """The ``sfi`` extension of a request: this sequence's budget."""

    model_config = ConfigDict(extra="forbid", strict=True)
    k_head: int | None = Field(default=None, ge=0)
    k_fraction: float | None = Field(default=None, gt=0.0, le=1.0)


MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1000
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # what torch.Generator.manual_seed takes, as int64

# Fields OpenAI defines that sfi does not implement, with the values that mean "not used":
# a request may send those (clients often do), any other value is refused by name.
NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
}
# Fields OpenAI defines that do not change what sfi generates: accepted, not used.
NO_EFFECT = {"user", "metadata", "store", "stream_options", "service_tier"}


def _same(value: Any, off: Any) -> bool:
    """``value == off``, with ``False`` not equal to ``0`` and ``None`` only to itself."""
    if value is None or off is None or isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return type(value) in (int, float, str, list, dict) and value == off


def _valid_unicode(text: str, name: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return text


class RequestFields(BaseModel):
    """What both endpoints take. Strict types (``"3"`` is not a number); ``null`` means the
    default, as in OpenAI's API."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool | None = None
    n: int | None = None
    mode: Literal["sfi", "full", "exact"] | None = None  # None: the server's default
    sfi: BudgetOverride | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(f"only n = 1 is supported (got {n}); send parallel requests")
        return n

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(stops)})")
        for text in stops:
            if not text or len(text) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
            _valid_unicode(text, "stop")
        return stop

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check_fields(self) -> None:
        """Refuse, by name, a field sfi does not implement or does not know."""
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT:
                continue
            if name in NOT_SUPPORTED:
                if any(_same(value, off) for off in NOT_SUPPORTED[name]):
                    continue
                raise APIError(400, f"{name} is not supported by this server "
                               f"(send it unset or {NOT_SUPPORTED[name][-1]!r})", param=name,
                               code="unsupported_parameter")
            raise APIError(400, f"unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
        if self._asked_max_tokens is not None and self.max_completion_tokens is not None \
                and self._asked_max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one",
                           param="max_completion_tokens")

    @property
    def _asked_max_tokens(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) unless ``max_tokens`` was sent."""
        if self.max_completion_tokens is not None and self._asked_max_tokens is None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(RequestFields):
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, prompt: str) -> str:
        return _valid_unicode(prompt, "prompt")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _unicode(cls, content: str | list[TextPart]) -> str:
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return _valid_unicode(text, "content")


class ChatRequest(RequestFields):
    messages: list[ChatMessage] = Field(min_length=1)

    @field_validator("messages")
    @classmethod
    def _not_blank(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if all(not m.content.strip() for m in messages):
            raise ValueError("every message is empty")
        return messages


def error_response(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
