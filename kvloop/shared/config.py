"""Typed service configuration: one dataclass per service, every field a flag with a ``KVLOOP_`` env twin.

Precedence, highest first: command-line flag, environment variable, YAML file (``--config``), default.
The YAML file rejects unknown keys. ``validate()`` runs at start and raises ``ConfigError`` naming
the bad field, so a typo fails loudly instead of falling back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import socket
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import yaml

from kvloop.shared.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None, secret: bool = False,
            dashed_value: bool = False) -> Any:
    """Declare a config field: its default, its help text and (for strings) the allowed values. A ``secret``
    (an API key) is left out of the config's ``repr``, so logging a config never prints it. A ``dashed_value``
    flag takes values that start with ``-`` (other programs' arguments): see :func:`join_dashed_values`."""
    return dataclasses.field(default=default, repr=not secret,
                             metadata={"help": help, "choices": choices, "dashed_value": dashed_value})


def field_default(cls: type, name: str) -> Any:
    """The default dataclass ``cls`` declares for its field ``name``: how a setting elsewhere names that one default
    instead of typing it again (``setting(field_default(Limits, "engine_ttl_s"), ...)``). Read from the fields, not
    the class attribute, which a slotted dataclass replaces with its slot."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no plain default")
            return f.default
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def join_dashed_values(argv: Sequence[str], flags: Iterable[str]) -> list[str]:
    """``--flag VALUE`` -> ``--flag=VALUE`` for ``flags`` whose values may start with ``-``: argparse takes such a
    value for an option of its own (``--extra-vllm-args "--no-enable-prefix-caching"`` would fail), so users
    could only write the ``=`` form."""
    wanted, out, i = set(flags), [], 0
    argv = list(argv)
    while i < len(argv):
        if argv[i] in wanted and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _field_type(cls: type, f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(cls)
    tp = hints[f.name]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    return typing.cast(type, tp)


def _coerce(name: str, tp: type, raw: Any) -> Any:
    if raw is None:
        return None
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"expected a boolean ({'/'.join(sorted(_TRUE | _FALSE))})")
        if tp is int:
            if (isinstance(raw, bool) or not isinstance(raw, int | float | str)
                    or (isinstance(raw, float) and not raw.is_integer())):
                raise ValueError("expected an integer")
            return int(raw)
        if tp is float:
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ValueError("expected a number")
            return float(raw)
        if tp is Path:
            if not isinstance(raw, str | Path):
                raise ValueError("expected a path")
            return Path(raw)
        if tp is str:
            if not isinstance(raw, str | int | float):
                raise ValueError("expected a string")
            return str(raw)
        if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
            # A word of the vocabulary (an engine's role): its member. An enum field lists its words as choices,
            # so a word not among them is refused by that check, naming the flag, variable or file it came from.
            if not isinstance(raw, str):
                raise ValueError("expected a string")
            return tp(raw) if raw in {member.value for member in tp} else raw
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc} (got {raw!r})", field=name) from None
    raise ConfigError(f"{name}: unsupported config type {tp}", field=name)


class ServiceConfig:
    """Mixin for service config dataclasses. Subclasses set ``ENV_PREFIX`` (``KVLOOP_BROKER_``)."""

    ENV_PREFIX: ClassVar[str] = "KVLOOP_"

    @classmethod
    def env_name(cls, field_name: str) -> str:
        return cls.ENV_PREFIX + field_name.upper()

    @classmethod
    def flag_name(cls, field_name: str) -> str:
        return "--" + field_name.replace("_", "-")

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field[Any], ...]:
        return dataclasses.fields(typing.cast(Any, cls))

    @classmethod
    def dashed_value_flags(cls) -> list[str]:
        return [cls.flag_name(f.name) for f in cls.fields() if f.metadata.get("dashed_value")]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field; defaults stay ``None`` so unset flags don't mask env or file."""
        parser.add_argument("--config", type=Path, default=None, help="YAML file with these settings")
        for f in cls.fields():
            tp = _field_type(cls, f)
            help_text = f"{f.metadata.get('help', '')} [env {cls.env_name(f.name)}; default {f.default!r}]"
            kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["metavar"] = f.name.upper()
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
            parser.add_argument(cls.flag_name(f.name), **kwargs)

    @classmethod
    def load(
        cls,
        args: argparse.Namespace | Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: Path | None = None,
    ) -> Self:
        """Merge flags, env and file over the defaults, then ``validate()``."""
        env = os.environ if env is None else env
        flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        config_file = config_file or flags.get("config") or (
            Path(env[cls.ENV_PREFIX + "CONFIG"]) if cls.ENV_PREFIX + "CONFIG" in env else None
        )
        file_values: dict[str, Any] = {}
        if config_file is not None:
            file_values = cls._read_file(Path(config_file))
        # Other subcommand arguments share the namespace: only our fields are read from it.
        values: dict[str, Any] = {}
        for f in cls.fields():
            tp = _field_type(cls, f)
            if flags.get(f.name) is not None:
                raw, origin = flags[f.name], cls.flag_name(f.name)
            elif cls.env_name(f.name) in env:
                raw, origin = env[cls.env_name(f.name)], cls.env_name(f.name)
            elif f.name in file_values:
                raw, origin = file_values[f.name], f"{config_file}: {f.name}"
            else:
                continue
            value = _coerce(f.name, tp, raw)
            if value is None and f.default is not None:  # e.g. ``listen:`` left empty in the YAML file
                raise ConfigError(f"{f.name}: a value is required (got null from {origin})", field=f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{f.name}: {value!r} from {origin} is not one of {list(choices)}", field=f.name)
            values[f.name] = value
        config = cls(**values)
        config.validate()
        return config

    @classmethod
    def _read_file(cls, path: Path) -> dict[str, Any]:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config: cannot read {path}: {exc}", field="config") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config: {path} must hold a mapping of settings", field="config")
        known = {f.name for f in cls.fields()}
        unknown = sorted(str(k) for k in data if str(k).replace("-", "_") not in known)
        if unknown:
            raise ConfigError(
                f"config: unknown key(s) {unknown} in {path}; known: {sorted(known)}", field=unknown[0]
            )
        return {str(k).replace("-", "_"): v for k, v in data.items()}

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad field. Subclasses extend this."""

    # Small helpers for validate() implementations.
    def _require(self, ok: bool, field: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{field}: {why} (got {getattr(self, field)!r})", field=field)


def process_name() -> str:
    """This process's name among its peers when none is configured: host and pid (a broker replica's id in
    leader election, a router's name for its in-flight counts where nobody is authenticated)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def parse_host_port(value: str, field: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``), raising ``ConfigError`` naming ``field``."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{field}: expected host:port (got {value!r})", field=field)
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{field}: port must be a number (got {value!r})", field=field) from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{field}: port out of range (got {value!r})", field=field)
    return host.strip("[]"), port
