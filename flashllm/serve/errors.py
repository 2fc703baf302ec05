"""The error a request gets: an HTTP status and OpenAI's {"error": {...}} body (serve/app.py
sends it; the Ollama routes send its message in Ollama's {"error": ...})."""
from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, \
            code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
