"""kvloop's shared package: block keys, errors, config, telemetry, the broker client and the CLI.

Importing ``kvloop`` is cheap and starts nothing (vLLM imports the engines' connector, which uses the
block keys, in every process). Heavier pieces live in submodules: ``kvloop.client`` (gRPC),
``kvloop.telemetry``, ``kvloop.config``, ``kvloop.procs``, and the generated ``kvloop.v1`` stubs.
"""

from kvloop.errors import (
    AlreadyExists,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    KvloopError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvloop.hashing import KEY_BYTES, ExtraKeys, block_keys, common_prefix_blocks, layout_fingerprint

__all__ = [
    "KEY_BYTES",
    "AlreadyExists",
    "ConfigError",
    "ExtraKeys",
    "FailedPrecondition",
    "InvalidArgument",
    "KvloopError",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
    "block_keys",
    "common_prefix_blocks",
    "layout_fingerprint",
]
