"""OpenAI request bodies (the subset TIDE serves) and OpenAI-style error responses.

Every field is bounded here (OpenAI's bounds where it has them), so a value the engine could not
use is a 400 naming the field, never an error inside a step that other requests share.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from tide.serving.sampling import INT64_MAX, SEED_MAX, SEED_MIN, SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # the stream holds back this many characters less one
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256
MAX_MODEL_NAME = 256


def _unicode(s: str) -> str:
    """JSON may carry lone surrogates (\\ud800), which no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=MAX_MODEL_NAME)
    # upper bounds past the first: the model's room (prompt + max_tokens <= context), checked on submit
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=INT64_MAX)  # extension, as in vLLM; >= vocab: off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    ignore_eos: bool = False  # extension, as in vLLM

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    # a token list is bounded by the context (checked on submit) and the body size
    prompt: Text | list[int] = Field(min_length=1)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": None}},
    )


_TAGS = {"str", "int", "float", "bool", "none"}


def describe(e: ValidationError) -> tuple[str, str | None]:
    """The first validation problem as (message, parameter name); values are not echoed back."""
    err = e.errors(include_input=False, include_url=False)[0]
    # field names and list indices only: no union member tags ("str", "function-after[...]")
    loc = ".".join(str(x) for x in err["loc"] if isinstance(x, int) or (x.isidentifier() and x not in _TAGS))
    msg = str(err["msg"]).removeprefix("Value error, ")
    return (f"{loc}: {msg}" if loc else msg), (str(err["loc"][0]) if err["loc"] else None)
