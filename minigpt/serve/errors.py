"""OpenAI's error JSON for the server's refusals, {"error": {"message", "type", "param", "code"}}: APIError,
pydantic's complaints about a body as one APIError naming the field, and a body FastAPI could not parse."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from minigpt.serve.protocol import ONLY_DEFAULT

__all__ = ["APIError", "unparsable_body", "validation_error"]

HALF_CHARACTER = (
    "the text holds half of a UTF-16 surrogate pair (a \\ud800-\\udfff escape without its other half), which is no "
    "character; send whole characters"
)
ONE_PROMPT = "send the prompt as one string: this server completes one text a request, not a list of prompts or ids"
NOT_JSON = "the request body is not valid JSON; send a JSON object (Content-Type: application/json)"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
            status_code=self.status,
            headers=headers,
        )


def union_member(part: object) -> bool:
    """A part of pydantic's error location that names the union member it tried: a type, CamelCase or with brackets."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none")
        or "[" in part
        or part[:1].isupper()
        or part.startswith("constrained-")  # a str with a min_length
    )


def field_path(loc: tuple) -> str | None:
    """pydantic's location of an error as the request's field: messages.0.content, not body.messages.0.content.str."""
    return ".".join(str(part) for part in loc[1:] if not union_member(part)) or None


def validation_error(e: RequestValidationError, content_type: str | None = None) -> APIError:
    """pydantic's complaint about a body, as one 400 naming the field.  Of a union's complaints, the one about the
    member the value has the type of (a list of 5 stop sequences is too long, not "not a string").  content_type:
    the request's header, named when it is why the body was not read as JSON."""
    error = min(e.errors(), key=lambda error: error["type"].endswith("_type"))
    param = field_path(error["loc"])
    if error["type"] == "extra_forbidden":  # the last part is the client's own key, whatever it looks like
        param = ".".join(filter(None, [field_path(error["loc"][:-1]), str(error["loc"][-1])]))
    if error["type"] == "json_invalid":
        return APIError(400, NOT_JSON, code="invalid_json")
    # FastAPI parses a body only when its Content-Type says JSON, else passes on the bytes (a web page may post
    # text/plain to any server without a CORS check, so JSON must be declared); `curl -d` sends a form's type
    if param is None and isinstance(error.get("input"), bytes):
        sent = f"is {content_type[:100]}, not application/json" if content_type else "is missing"
        return APIError(
            400,
            f"the request's Content-Type {sent}; send the JSON object with the header Content-Type: application/json",
            code="invalid_content_type",
        )
    if error["type"] == "extra_forbidden":
        return APIError(
            400,
            f"unrecognized request argument supplied: {param} (not an OpenAI field, or one this "
            "server does not support)",
            param,
            "unsupported_parameter",
        )
    if error["type"] == "missing" and param is None:  # the body itself: nothing was sent
        return APIError(
            400,
            "the request body is empty; send a JSON object with the request's fields (Content-Type: application/json)",
            code="invalid_json",
        )
    if error["type"] == "string_unicode":  # a lone surrogate (protocol.whole_characters, or pydantic's own check)
        return APIError(400, f"{param or 'body'}: {HALF_CHARACTER}", param, "invalid_value")
    if param == "prompt" and error["type"] == "string_type":  # OpenAI's batches: a list of prompts, or token ids
        return APIError(400, f"prompt: {ONE_PROMPT}", param, "invalid_type")
    if param in ONLY_DEFAULT:
        return APIError(400, f"{param}: unsupported value: {ONLY_DEFAULT[param]}", param, "unsupported_value")
    if error["type"] == "missing":
        return APIError(400, f"missing required parameter: {param}", param, "missing_required_parameter")
    return APIError(400, f"{param or 'body'}: {error['msg']}", param, "invalid_value")


def unparsable_body(cause: BaseException) -> APIError:
    """A JSON body FastAPI could not parse, which it reports only as "There was an error parsing the body", as a
    400 saying why (cause: what its parser raised)."""
    if isinstance(cause, UnicodeDecodeError):
        where = f"byte 0x{cause.object[cause.start]:02x} at position {cause.start}"
        return APIError(
            400,
            f"the request body is not valid JSON: {where} is not UTF-8; send a JSON object as UTF-8 text "
            "(Content-Type: application/json)",
            code="invalid_json",
        )
    if isinstance(cause, RecursionError):  # Python's parser stops near 1,000 levels
        return APIError(
            400,
            "the request body is JSON nested too deep to read (a request is a few levels deep); send a JSON object "
            "with the request's fields (Content-Type: application/json)",
            code="invalid_json",
        )
    return APIError(400, NOT_JSON, code="invalid_json")
