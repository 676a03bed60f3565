"""OpenAI's error JSON for the server's refusals, {"error": {"message", "type", "param", "code"}}: APIError, and
pydantic's complaints about a body as one APIError naming the field."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

__all__ = ["APIError", "validation_error"]


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
        part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper()
    )


def field_path(loc: tuple) -> str | None:
    """pydantic's location of an error as the request's field: messages.0.content, not body.messages.0.content.str."""
    return ".".join(str(part) for part in loc[1:] if not union_member(part)) or None


def validation_error(e: RequestValidationError) -> APIError:
    """pydantic's complaint about a body, as one 400 naming the field.  Of a union's complaints, the one about the
    member the value has the type of (a list of 5 stop sequences is too long, not "not a string")."""
    error = min(e.errors(), key=lambda error: error["type"].endswith("_type"))
    param = field_path(error["loc"])
    if error["type"] == "json_invalid":
        return APIError(
            400,
            "the request body is not valid JSON; send a JSON object (Content-Type: application/json)",
            code="invalid_json",
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
    if error["type"] == "missing":
        return APIError(400, f"missing required parameter: {param}", param, "missing_required_parameter")
    return APIError(400, f"{param or 'body'}: {error['msg']}", param, "invalid_value")
