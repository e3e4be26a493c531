"""One exception root for kvloop. Each error names a status so the gRPC and HTTP shells can map it
without knowing where it came from."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAVAILABLE = "UNAVAILABLE"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class KvloopError(Exception):
    """Root of every error kvloop raises on purpose."""

    status: Status = Status.FAILED_PRECONDITION

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class InvalidArgument(KvloopError):
    status = Status.INVALID_ARGUMENT


class NotFound(KvloopError):
    status = Status.NOT_FOUND


class FailedPrecondition(KvloopError):
    status = Status.FAILED_PRECONDITION


class ResourceExhausted(KvloopError):
    status = Status.RESOURCE_EXHAUSTED


class AlreadyExists(KvloopError):
    status = Status.ALREADY_EXISTS


class Unavailable(KvloopError):
    status = Status.UNAVAILABLE


class PermissionDenied(KvloopError):
    """An authenticated caller asked for something its role or identity may not do (:mod:`kvloop.broker.access`)."""

    status = Status.PERMISSION_DENIED


class ConfigError(InvalidArgument):
    """A configuration value failed validation; ``field`` names it."""
