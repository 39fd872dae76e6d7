"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.kind, self.headers)


def error_response(status: int, message: str, param: str | None, kind: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_named(message: str) -> str | None:
    """The field a ValueError names: SamplingParams' and the protocol's messages start with it
    (`temperature=...`, `top_p: ...`, `response_format.type: ...`)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head.replace(".", "").replace("_", "").isalnum() and " " not in head else None
