"""The errors a turn ends with: :class:`TurnError` is what the client gets (an HTTP status and an OpenAI-style
body); :class:`EngineReplyError` is an engine's own error reply, passed on as a TurnError when it is the
request's fault (4xx) and tried on another engine when it is the engine's (5xx)."""

from __future__ import annotations

from typing import Any


class TurnError(Exception):
    """A turn that cannot be served: the HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, kind: str = "server_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class EngineReplyError(Exception):
    def __init__(self, status: int, data: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status, self.data = status, data

    def turn_error(self) -> TurnError:
        """The engine's own OpenAI error, passed on with its status (a bad request stays a bad request)."""
        error = self.data.get("error") if isinstance(self.data, dict) else None
        if isinstance(error, dict):
            kind = str(error.get("type", "invalid_request_error"))
            return TurnError(self.status, str(error.get("message", "")), kind, error.get("param"))
        message = self.data.get("message", str(self.data)) if isinstance(self.data, dict) else str(self.data)
        return TurnError(self.status, str(message), "invalid_request_error")
