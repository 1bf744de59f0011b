"""Server error wording (web/errors.py): invalid JSON is said once."""

from __future__ import annotations

import pydantic

from atom_runtime.web.errors import from_validation_error, invalid_json_message


class _Body(pydantic.BaseModel):
    prompt: str


def test_invalid_json_is_said_once():
    try:
        _Body.model_validate_json(b'{"prompt": "Hi",')
    except pydantic.ValidationError as e:
        error = from_validation_error(e)
    body = error.body()["error"]
    assert body["code"] == "invalid_json" and error.status == 400
    assert body["message"].startswith("the request body is not valid JSON: ")
    assert "invalid json" not in body["message"].lower().split(": ", 1)[1]
    assert invalid_json_message("EOF while parsing") == (
        "the request body is not valid JSON: EOF while parsing"
    )
