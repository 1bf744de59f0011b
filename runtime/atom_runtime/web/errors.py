"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every way a request can be refused ends here: pydantic validation errors (param = the field path,
e.g. `messages[0].role`), the engine's and SamplingParams' `ValueError("field: message")`, an
unknown model, a bad API key, a dead engine.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError


class APIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def invalid_api_key() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided; send it as `Authorization: Bearer <key>`.",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def engine_unavailable(message: str = "the engine is not available") -> APIError:
    return APIError(503, message, "service_unavailable_error", None, "engine_unavailable")


def shutting_down(message: str) -> APIError:
    """A request the server stopped because it is shutting down (a retry goes to another pod)."""
    return APIError(503, message, "service_unavailable_error", None, "server_shutting_down")


def field_path(loc: tuple) -> str | None:
    """pydantic's loc ('messages', 0, 'role') -> 'messages[0].role'; () -> None."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def from_validation_error(
    error: ValidationError, renames: Mapping[str, str] | None = None
) -> APIError:
    """The first validation error, with the field path as `param`."""
    first = error.errors(include_url=False)[0]
    loc = _strip_union_tags(tuple(first["loc"]))
    if first["type"] == "json_invalid":
        return bad_request(invalid_json_message(first["msg"]), None, "invalid_json")
    param = field_path(loc)
    if param is not None and renames:
        param = renames.get(param, param)
    where = f"{param}: " if param else "request body: "
    return bad_request(f"{where}{first['msg']}", param, first["type"])


def invalid_json_message(detail: str) -> str:
    """ "the request body is not valid JSON: <where>", from pydantic's "Invalid JSON: <where>"
    (said once, not "invalid JSON: Invalid JSON: ...")."""
    head, sep, rest = detail.partition(":")
    if sep and head.strip().lower() == "invalid json":
        detail = rest.strip()
    return f"the request body is not valid JSON: {detail}"


def _strip_union_tags(loc: tuple) -> tuple:
    # pydantic inserts the union member's type name ('str', 'list[int]', ...) into loc; those
    # are not fields the client wrote.
    return tuple(
        p for p in loc if isinstance(p, int) or not any(c in p for c in "[]") and p not in _TYPES
    )


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def from_value_error(error: ValueError, renames: Mapping[str, str] | None = None) -> APIError:
    """ValueError("field: message") from SamplingParams, the tokenizer or the engine."""
    text = str(error)
    field, sep, _ = text.partition(": ")
    if not sep or not field or " " in field:
        return bad_request(text, None)
    param = renames.get(field, field) if renames else field
    message = text if param == field else f"{param}: {text[len(field) + 2 :]}"
    return bad_request(message, param)
