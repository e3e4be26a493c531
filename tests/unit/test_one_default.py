"""One default per fact (issue 50): a default is typed once, in the lowest floor that needs it, and every other place
that offers the same setting names that one (``setting(SidecarConfig.retention_fraction, ...)``, a constant).

Read from the source with ``ast``: a default spelled as a literal is a home; the same fact spelled as a literal twice
is a duplicate that drifts the day one of them changes. Values are compared too, so a twin that names its home but
got a different value (another field, a typo) fails as well.
"""

from __future__ import annotations

import argparse
import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvloop.broker.config import BrokerConfig
from kvloop.broker.core import CostAwarePolicy, Limits, make_policy
from kvloop.engines import config as engine_config
from kvloop.engines.config import EngineConfig
from kvloop.engines.sidecar import config as sidecar_config
from kvloop.engines.sidecar.config import SidecarConfig
from kvloop.router.config import RouterConfig
from kvloop.shared import auth, telemetry
from kvloop.shared.config import ServiceConfig, field_default
from kvloop.shared.protocol import DEFAULT_HOLD_S

ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[type[ServiceConfig], Path] = {
    BrokerConfig: ROOT / "broker" / "config.py",
    RouterConfig: ROOT / "router" / "config.py",
    EngineConfig: ROOT / "engines" / "config.py",
    SidecarConfig: ROOT / "engines" / "sidecar" / "config.py",
}
DIFFERENT_FACTS = {
    "listen": "each service's own address (broker 50051, router 8080, sidecar a free port)",
    "metrics_listen": "each service's own address",
    "model": "the router's served model name, the engine's model directory",
    "port_file": "each service's own file",
}
"""Field names that several configs have for facts of their own: their defaults may differ."""
UNSET = (None, "", False)
"""Defaults that say "not set" or "off" rather than a figure: the same literal in several places is no shared fact."""


def is_literal(node: ast.expr) -> bool:
    """A value typed here (``0.5``, ``"auto"``, ``4 * 1024``), not a name of one defined elsewhere."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return is_literal(node.left) and is_literal(node.right)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(is_literal(e) for e in node.elts)
    return False


def setting_defaults(cls: type, path: Path) -> dict[str, ast.expr]:
    """Field name -> the expression ``setting(...)`` gets as its default, in ``cls``'s body in ``path``."""
    tree = ast.parse(path.read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    out: dict[str, ast.expr] = {}
    for node in body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "setting"):
            out[node.target.id] = node.value.args[0]
    return out


def default(cls: type, name: str) -> Any:
    return field_default(cls, name)


def shared_names() -> Iterator[str]:
    counts: dict[str, int] = {}
    for cls in CONFIGS:
        for f in cls.fields():
            counts[f.name] = counts.get(f.name, 0) + 1
    yield from sorted(name for name, n in counts.items() if n > 1 and name not in DIFFERENT_FACTS)


def test_the_reader_sees_every_setting_of_every_config() -> None:
    for cls, path in CONFIGS.items():
        assert set(setting_defaults(cls, path)) == {f.name for f in cls.fields()}, cls
    assert is_literal(ast.parse("4 * 1024 * -1", mode="eval").body)
    assert not is_literal(ast.parse("SidecarConfig.lease_ttl_s", mode="eval").body)


@pytest.mark.parametrize("name", list(shared_names()))
def test_a_setting_several_configs_offer_has_one_default_typed_once(name: str) -> None:
    having = [cls for cls in CONFIGS if any(f.name == name for f in cls.fields())]
    values = {cls.__name__: default(cls, name) for cls in having}
    assert len({repr(v) for v in values.values()}) == 1, f"{name}: the configs disagree on its default: {values}"
    if values[having[0].__name__] in UNSET:
        return
    typed = [cls.__name__ for cls in having if is_literal(setting_defaults(cls, CONFIGS[cls])[name])]
    assert len(typed) <= 1, (f"{name}: its default is typed in {typed}; keep it in the lowest floor's and name that "
                             "one elsewhere (setting(Home.field, ...) or a constant)")


def test_the_launchers_twins_of_the_sidecars_settings_name_the_sidecars_defaults() -> None:
    for name in ("role", "retention_fraction", "lease_ttl_s", "hold_s"):
        assert default(EngineConfig, name) is default(SidecarConfig, name), name
        assert not is_literal(setting_defaults(EngineConfig, CONFIGS[EngineConfig])[name]), name
    # The hold is the engine protocol's (the connector's kvloop_hold_s too): neither config types it.
    assert default(SidecarConfig, "hold_s") is DEFAULT_HOLD_S
    assert not is_literal(setting_defaults(SidecarConfig, CONFIGS[SidecarConfig])["hold_s"])
    assert engine_config.ROLES is sidecar_config.ROLES
    assert engine_config.ZMQ_SCHEMES is sidecar_config.ZMQ_SCHEMES


def test_every_services_log_defaults_are_the_telemetry_modules() -> None:
    for cls, path in CONFIGS.items():
        assert default(cls, "log_format") == telemetry.DEFAULT_LOG_FORMAT in telemetry.LOG_FORMATS
        assert default(cls, "log_level") == telemetry.DEFAULT_LOG_LEVEL in telemetry.LOG_LEVELS
        typed = setting_defaults(cls, path)
        assert not is_literal(typed["log_format"]) and not is_literal(typed["log_level"]), cls
    signature = inspect.signature(telemetry.configure_logging).parameters
    assert signature["fmt"].default == telemetry.DEFAULT_LOG_FORMAT
    assert signature["level"].default == telemetry.DEFAULT_LOG_LEVEL
    assert parameter_defaults(ROOT / "kvloop" / "shared" / "telemetry.py", "configure_logging") == {
        "fmt": False, "level": False}


# ---------------------------------------------------------------------------- twins outside the config classes


def parameter_defaults(path: Path, function: str) -> dict[str, bool]:
    """Parameter -> whether its default is a literal, for every ``function`` (or method) of that name in ``path``."""
    out: dict[str, bool] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True),
                     *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)]
            out.update({a.arg: is_literal(d) for a, d in pairs})
    return out


def flag_keywords(path: Path, flag: str) -> dict[str, bool]:
    """Keyword -> whether it is a literal, for the ``add_argument(flag, ...)`` calls in ``path``."""
    out: dict[str, bool] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == flag):
            out.update({k.arg: is_literal(k.value) for k in node.keywords if k.arg})
    assert out, f"no add_argument({flag!r}) in {path}"
    return out


def test_the_cost_policys_half_life_is_typed_once() -> None:
    home = CostAwarePolicy.recency_half_life_s
    assert default(BrokerConfig, "recency_half_life_s") == home
    assert inspect.signature(make_policy).parameters["recency_half_life_s"].default == home
    assert parameter_defaults(ROOT / "broker" / "core" / "eviction.py", "make_policy") == {
        "recency_half_life_s": False}


def test_the_engine_ttl_is_typed_once() -> None:
    from kvloop.broker.store.etcd import EtcdStore

    home = field_default(Limits, "engine_ttl_s")
    assert default(BrokerConfig, "engine_ttl_s") == home
    assert inspect.signature(EtcdStore.__init__).parameters["engine_ttl_s"].default == home
    assert parameter_defaults(ROOT / "broker" / "store" / "etcd.py", "__init__")["engine_ttl_s"] is False


def test_the_commands_defaults_are_the_services() -> None:
    from kvloop.app.cli import build_parser
    from kvloop.app.cluster import add_arguments

    cli, cluster = ROOT / "kvloop" / "app" / "cli.py", ROOT / "kvloop" / "app" / "cluster.py"
    parser = build_parser()
    assert parser.parse_args(["broker", "status"]).broker == default(BrokerConfig, "listen")
    assert flag_keywords(cli, "--broker")["default"] is False
    fingerprint = parser.parse_args(["model", "fingerprint", "--model", "m"])
    assert fingerprint.dtype == default(EngineConfig, "dtype")
    assert flag_keywords(cli, "--dtype")["default"] is False
    token = parser.parse_args(["auth", "token", "--secret-file", "s", "--role", "router", "--subject", "r",
                               "--out", "o"])
    assert token.role == "router"
    assert flag_keywords(cli, "--role")["choices"] is False
    with pytest.raises(SystemExit):
        parser.parse_args(["auth", "token", "--secret-file", "s", "--role", "admin", "--subject", "r", "--out", "o"])

    up = argparse.ArgumentParser()
    add_arguments(up)
    args = up.parse_args([])
    assert args.router_listen == default(RouterConfig, "listen")
    assert args.kv_cache_gib == default(EngineConfig, "kv_cache_gib")
    for flag in ("--router-listen", "--kv-cache-gib"):
        assert flag_keywords(cluster, flag)["default"] is False, flag
    assert auth.ROLES == ("engine", "router", "operator")
