"""The request bodies of OpenAI's Chat Completions and Completions APIs that minigpt serves, as pydantic models.

Each body is checked once, here, as FastAPI reads it: a wrong type, a value out of range or a field OpenAI does not
know is a 400 naming the field (minigpt.serve.app turns pydantic's errors into OpenAI's error JSON).  Fields that
OpenAI knows but minigpt cannot honour (tools, logprobs, n > 1, penalties) are refused the same way rather than
silently ignored; their defaults (a penalty of 0, an empty `logit_bias`, a text `response_format`) and metadata
(`user`, `safety_identifier`, `prompt_cache_key`) are accepted, since many clients always send them.  `top_k` is an
extension, as in vLLM and llama.cpp.  Strict mode: a number given as a string is a wrong type, not converted; a
field set to null counts as left out, as OpenAI reads it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["ONLY_DEFAULT", "ChatRequest", "CompletionRequest", "Message"]

MAX_SEED = 2**63 - 1

# OpenAI's fields that this server takes at their default only: what a refusal says instead of pydantic's "Input
# should be None" or "less than or equal to 0" (which, for a penalty of -1, reads as if 0.5 would do)
ONLY_DEFAULT = {
    "n": "this server gives one choice per request; leave n out or send 1 (send n requests for n choices)",
    "presence_penalty": "this server applies no penalties; leave presence_penalty out or send 0",
    "frequency_penalty": "this server applies no penalties; leave frequency_penalty out or send 0",
    "logprobs": "this server returns no log probabilities; leave logprobs out",
    "echo": "this server does not echo the prompt; leave echo out or send false",
    "best_of": "this server gives one completion per request; leave best_of out or send 1",
    "logit_bias": "this server applies no logit bias; leave logit_bias out or send {}",
    "response_format.type": "this server writes free text only, no JSON mode or schema; leave response_format out "
    'or send {"type": "text"}',
}


def whole_characters(text: str) -> str:
    """JSON may escape half of a UTF-16 surrogate pair alone ("\\ud83d": an emoji cut in two), which is no character:
    a byte tokenizer took it as invalid UTF-8, and a model name holding one was echoed in a 404 that could not be
    encoded (a 500).  Refused as pydantic refuses one in a string with a length bound (minigpt.serve.errors words
    both)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("string_unicode", "half of a UTF-16 surrogate pair") from None
    return text


Text = Annotated[str, AfterValidator(whole_characters)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def null_is_not_given(cls, data: object) -> object:
        """OpenAI reads a field set to null as a field left out (clients send `"temperature": null`)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class TextPart(Body):
    type: Literal["text"]
    text: Text


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: Text | list[TextPart]
    name: Text | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(Body):
    include_usage: bool = False


class ResponseFormat(Body):
    type: Literal["text"]


StopText = Annotated[str, Field(min_length=1), AfterValidator(whole_characters)]  # "" would end every reply at once
Stop = StopText | Annotated[list[StopText], Field(max_length=4)] | None


class Sampling(Body):
    """What both endpoints share."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)  # NaN: "a finite number", not "<= 2"
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    stop: Stop = None
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] = {}
    user: Text | None = None

    @field_validator("stream_options")
    @classmethod
    def only_when_streaming(cls, value: StreamOptions, info: ValidationInfo) -> StreamOptions:
        """As OpenAI: options for a stream that is not asked for are a mistake, not something to ignore."""
        if info.data.get("stream", True) is False:  # absent: stream itself was refused
            raise PydanticCustomError(
                "stream_options", "only allowed when stream is true; send stream: true or leave stream_options out"
            )
        return value

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit_field(self) -> str:
        """The field that set the reply's token limit, for an error about it."""
        return "max_tokens"


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: Literal[False] = False
    response_format: ResponseFormat | None = None
    safety_identifier: Text | None = None  # who is asking and a cache key: metadata, accepted as `user` is
    prompt_cache_key: Text | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(Sampling):
    prompt: Text
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Literal[1] = 1
