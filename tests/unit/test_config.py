"""Typed configuration: kvloop.shared.config's merge of flags, env, YAML and defaults, and BrokerConfig's checks."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvloop.broker.config import BrokerConfig
from kvloop.shared.config import ServiceConfig, parse_host_port, setting
from kvloop.shared.errors import ConfigError, InvalidArgument
from kvloop.shared.vocabulary import Role


@dataclass(frozen=True)
class DemoConfig(ServiceConfig):
    ENV_PREFIX = "DEMO_"

    count: int = setting(3, "an integer")
    ratio: float = setting(0.5, "a float")
    name: str = setting("x", "a string with choices", choices=("x", "y"))
    flag: bool = setting(False, "a boolean")
    path: Path | None = setting(None, "an optional path")

    def validate(self) -> None:
        self._require(self.count >= 0, "count", "must not be negative")


def write_yaml(tmp_path: Path, data: Any, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def config_error(fn: Any, field: str, *, starts_with: str | None = None) -> ConfigError:
    """``fn`` raises a ConfigError for ``field`` whose message starts with the field (or ``starts_with``)."""
    with pytest.raises(ConfigError) as exc:
        fn()
    assert exc.value.field == field, str(exc.value)
    assert str(exc.value).startswith(starts_with or field), str(exc.value)
    return exc.value


def broker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    BrokerConfig.add_arguments(parser)
    return parser


# ------------------------------------------------------------------------------------------ precedence


def test_defaults() -> None:
    config = BrokerConfig.load({}, env={})
    assert config == BrokerConfig()
    assert config.threshold_tokens == 64 and config.store == "memory" and config.default_ttl_s == 480.0
    assert DemoConfig.load(None, env={}) == DemoConfig()


@pytest.mark.parametrize(
    ("flag", "env", "file", "expected"),
    [
        ("30", "20", 10, 30),
        (None, "20", 10, 20),
        (None, None, 10, 10),
        (None, None, None, 64),
        ("30", None, 10, 30),
        ("30", "20", None, 30),
        (None, "20", None, 20),
    ],
)
def test_precedence_flag_env_file_default(tmp_path: Path, flag: str | None, env: str | None, file: int | None,
                                          expected: int) -> None:
    argv = ["--threshold-tokens", flag] if flag is not None else []
    environ = {"KVLOOP_BROKER_THRESHOLD_TOKENS": env} if env is not None else {}
    if file is not None:
        argv += ["--config", str(write_yaml(tmp_path, {"threshold_tokens": file}))]
    config = BrokerConfig.load(broker_parser().parse_args(argv), env=environ)
    assert config.threshold_tokens == expected


def test_each_field_from_its_own_layer(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"default_ttl_s": 77, "eviction_policy": "lru", "threshold_tokens": 1})
    args = broker_parser().parse_args(["--config", str(path), "--threshold-tokens", "5", "--console-spans"])
    config = BrokerConfig.load(args, env={"KVLOOP_BROKER_STORE": "etcd", "KVLOOP_BROKER_DEFAULT_TTL_S": "66"})
    assert (config.threshold_tokens, config.default_ttl_s, config.eviction_policy, config.store) == (5, 66.0, "lru",
                                                                                                     "etcd")
    assert config.console_spans is True and config.max_block_keys == 8192


def test_unset_flags_do_not_mask_env_and_a_false_flag_beats_env() -> None:
    env = {"KVLOOP_BROKER_CONSOLE_SPANS": "true", "KVLOOP_BROKER_LISTEN": "0.0.0.0:7000"}
    config = BrokerConfig.load(broker_parser().parse_args([]), env=env)
    assert config.console_spans is True and config.listen == "0.0.0.0:7000"
    config = BrokerConfig.load(broker_parser().parse_args(["--no-console-spans"]), env=env)
    assert config.console_spans is False


def test_config_file_from_env_flag_or_argument(tmp_path: Path) -> None:
    from_env = write_yaml(tmp_path, {"threshold_tokens": 11}, "env.yaml")
    from_flag = write_yaml(tmp_path, {"threshold_tokens": 22}, "flag.yaml")
    env = {"KVLOOP_BROKER_CONFIG": str(from_env)}
    assert BrokerConfig.load({}, env=env).threshold_tokens == 11
    assert BrokerConfig.load({"config": from_flag}, env=env).threshold_tokens == 22
    assert BrokerConfig.load({}, env={}, config_file=from_flag).threshold_tokens == 22


def test_other_namespace_entries_are_ignored() -> None:
    args = argparse.Namespace(command="broker", broker_command="serve", func=print, threshold_tokens=9)
    assert BrokerConfig.load(args, env={}).threshold_tokens == 9


def test_load_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVLOOP_BROKER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KVLOOP_BROKER_THRESHOLD_TOKENS", "123")
    assert BrokerConfig.load({}).threshold_tokens == 123


def test_names() -> None:
    assert BrokerConfig.env_name("default_ttl_s") == "KVLOOP_BROKER_DEFAULT_TTL_S"
    assert BrokerConfig.flag_name("default_ttl_s") == "--default-ttl-s"
    help_text = broker_parser().format_help()
    assert "--default-ttl-s" in help_text and "KVLOOP_BROKER_DEFAULT_TTL_S" in help_text


# ------------------------------------------------------------------------------------------ YAML files


def test_yaml_accepts_dashed_keys_and_empty_files(tmp_path: Path) -> None:
    config = BrokerConfig.load({}, env={}, config_file=write_yaml(tmp_path, {"max-block-keys": 12}))
    assert config.max_block_keys == 12
    assert BrokerConfig.load({}, env={}, config_file=write_yaml(tmp_path, "", "empty.yaml")) == BrokerConfig()


def test_yaml_rejects_unknown_keys_naming_them(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"threshold_tokens": 1, "treshold_tokens": 2, "zzz": 3})
    exc = config_error(lambda: BrokerConfig.load({}, env={}, config_file=path), "treshold_tokens",
                       starts_with="config: unknown key")
    assert "treshold_tokens" in str(exc) and "zzz" in str(exc) and str(path) in str(exc)


@pytest.mark.parametrize("content", ["- a\n- b\n", "just a string\n", "threshold_tokens: [1\n"])
def test_yaml_that_is_not_a_mapping_of_settings(tmp_path: Path, content: str) -> None:
    path = write_yaml(tmp_path, content)
    config_error(lambda: BrokerConfig.load({}, env={}, config_file=path), "config")


def test_missing_yaml_file(tmp_path: Path) -> None:
    config_error(lambda: BrokerConfig.load({}, env={}, config_file=tmp_path / "nope.yaml"), "config")


def test_yaml_null(tmp_path: Path) -> None:
    config_error(lambda: BrokerConfig.load({}, env={}, config_file=write_yaml(tmp_path, {"listen": None})), "listen")
    config = BrokerConfig.load({}, env={}, config_file=write_yaml(tmp_path, {"port_file": None}, "ok.yaml"))
    assert config.port_file is None


# ------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(("raw", "expected"), [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_bool_from_env(raw: str, expected: bool) -> None:
    assert DemoConfig.load({}, env={"DEMO_FLAG": raw}).flag is expected


@pytest.mark.parametrize(("env", "field"), [
    ({"DEMO_FLAG": "maybe"}, "flag"),
    ({"DEMO_FLAG": ""}, "flag"),
    ({"DEMO_COUNT": "abc"}, "count"),
    ({"DEMO_COUNT": "1.5"}, "count"),
    ({"DEMO_COUNT": ""}, "count"),
    ({"DEMO_RATIO": "half"}, "ratio"),
    ({"DEMO_RATIO": ""}, "ratio"),
])
def test_parse_errors_from_env_name_the_field(env: dict[str, str], field: str) -> None:
    exc = config_error(lambda: DemoConfig.load({}, env=env), field)
    assert repr(next(iter(env.values()))) in str(exc)


@pytest.mark.parametrize(("value", "field"), [
    ({"count": 1.5}, "count"),
    ({"count": True}, "count"),
    ({"count": [1]}, "count"),
    ({"count": {"a": 1}}, "count"),
    ({"count": math.inf}, "count"),
    ({"ratio": True}, "ratio"),
    ({"ratio": [0.5]}, "ratio"),
    ({"ratio": "x"}, "ratio"),
    ({"flag": "perhaps"}, "flag"),
    ({"name": ["x"]}, "name"),
    ({"name": {"x": 1}}, "name"),
    ({"path": ["a"]}, "path"),
    ({"path": 3}, "path"),
])
def test_parse_errors_from_yaml_name_the_field(tmp_path: Path, value: dict[str, Any], field: str) -> None:
    path = write_yaml(tmp_path, value)
    config_error(lambda: DemoConfig.load({}, env={}, config_file=path), field)


def test_values_that_parse(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"count": 4.0, "ratio": 2, "flag": "yes", "name": "y", "path": "/tmp/p"})
    config = DemoConfig.load({}, env={}, config_file=path)
    assert config == DemoConfig(count=4, ratio=2.0, flag=True, name="y", path=Path("/tmp/p"))
    assert isinstance(config.count, int) and isinstance(config.ratio, float)
    config = DemoConfig.load({}, env={"DEMO_COUNT": " 7 ", "DEMO_RATIO": "1e-3", "DEMO_PATH": "rel/p"})
    assert (config.count, config.ratio, config.path) == (7, 0.001, Path("rel/p"))


def test_subclass_validate_runs_on_load() -> None:
    config_error(lambda: DemoConfig.load({"count": -1}, env={}), "count")


# ------------------------------------------------------------------------------------------ choices


@pytest.mark.parametrize(("field", "value"), [
    ("store", "etcd3"), ("eviction_policy", "fifo"), ("log_format", "xml"), ("log_level", "trace"),
])
def test_choices_enforced_from_env_and_file(tmp_path: Path, field: str, value: str) -> None:
    env_name = BrokerConfig.env_name(field)
    exc = config_error(lambda: BrokerConfig.load({}, env={env_name: value}), field)
    assert env_name in str(exc) and repr(value) in str(exc)
    path = write_yaml(tmp_path, {field: value})
    exc = config_error(lambda: BrokerConfig.load({}, env={}, config_file=path), field)
    assert str(path) in str(exc)


def test_choices_enforced_on_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        broker_parser().parse_args(["--store", "nope"])
    assert exc.value.code == 2 and "--store" in capsys.readouterr().err
    exc2 = config_error(lambda: BrokerConfig.load({"store": "nope"}, env={}), "store")
    assert "--store" in str(exc2)


def test_valid_choices() -> None:
    config = BrokerConfig.load({"store": "etcd", "eviction_policy": "lru", "log_format": "json"}, env={})
    assert (config.store, config.eviction_policy, config.log_format) == ("etcd", "lru", "json")
    assert DemoConfig.load({}, env={"DEMO_NAME": "y"}).name == "y"
    config_error(lambda: DemoConfig.load({}, env={"DEMO_NAME": "z"}), "name")


@dataclass(frozen=True)
class RoleConfig(ServiceConfig):
    ENV_PREFIX = "ROLE_"

    role: Role = setting(Role.BOTH, "a word of the vocabulary", choices=tuple(r.value for r in Role))


def test_a_vocabulary_field_loads_as_its_member_and_refuses_other_words(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    RoleConfig.add_arguments(parser)
    assert RoleConfig.load(parser.parse_args(["--role", "prefill"]), env={}).role is Role.PREFILL
    assert RoleConfig.load({}, env={"ROLE_ROLE": "decode"}).role is Role.DECODE
    assert RoleConfig.load({}, env={}, config_file=write_yaml(tmp_path, {"role": "both"})).role is Role.BOTH
    exc = config_error(lambda: RoleConfig.load({}, env={"ROLE_ROLE": "router"}), "role")
    assert "ROLE_ROLE" in str(exc) and "'router'" in str(exc) and "['prefill', 'decode', 'both']" in str(exc)
    config_error(lambda: RoleConfig.load({}, env={}, config_file=write_yaml(tmp_path, {"role": 3})), "role")


def test_the_engines_roles_are_the_vocabularys() -> None:
    from kvloop.engines.config import ROLES, EngineConfig
    from kvloop.engines.sidecar.config import ROLES as SIDECAR_ROLES
    from kvloop.engines.sidecar.config import SidecarConfig
    assert ROLES == SIDECAR_ROLES == ("prefill", "decode", "both")
    assert EngineConfig().role is SidecarConfig().role is Role.BOTH


# ------------------------------------------------------------------------------------------ validate()


@pytest.mark.parametrize(("overrides", "field"), [
    ({"listen": "no-port"}, "listen"),
    ({"listen": ":50051"}, "listen"),
    ({"listen": "127.0.0.1:http"}, "listen"),
    ({"listen": "127.0.0.1:70000"}, "listen"),
    ({"advertise": "broker"}, "advertise"),
    ({"metrics_listen": "9460"}, "metrics_listen"),
    ({"store": "etcd", "etcd_endpoint": "etcd"}, "etcd_endpoint"),
    ({"etcd_prefix": "kvloop/"}, "etcd_prefix"),
    ({"etcd_prefix": "/kvloop"}, "etcd_prefix"),
    ({"leader_ttl_s": 1}, "leader_ttl_s"),
    ({"default_ttl_s": 0}, "default_ttl_s"),
    ({"default_ttl_s": math.nan}, "default_ttl_s"),
    ({"default_ttl_s": math.inf}, "default_ttl_s"),
    ({"default_ttl_s": 0.5}, "default_ttl_s"),
    ({"min_ttl_s": -1}, "min_ttl_s"),
    ({"min_ttl_s": 10, "max_ttl_s": 5, "default_ttl_s": 7}, "max_ttl_s"),
    ({"default_pin_timeout_s": 200}, "default_pin_timeout_s"),
    ({"max_pin_timeout_s": 0}, "max_pin_timeout_s"),
    ({"engine_ttl_s": math.nan}, "engine_ttl_s"),
    ({"keepalive_interval_s": 10}, "keepalive_interval_s"),
    ({"keepalive_interval_s": 0}, "keepalive_interval_s"),
    ({"tick_interval_s": 0}, "tick_interval_s"),
    ({"recency_half_life_s": -5}, "recency_half_life_s"),
    ({"default_bandwidth_bytes_per_s": 0}, "default_bandwidth_bytes_per_s"),
    ({"default_prefill_tokens_per_s": -1}, "default_prefill_tokens_per_s"),
    ({"max_block_keys": 0}, "max_block_keys"),
    ({"max_message_bytes": 1000}, "max_message_bytes"),
    ({"max_id_len": 0}, "max_id_len"),
    ({"eviction_log_size": 0}, "eviction_log_size"),
    ({"default_bytes_per_block": 0}, "default_bytes_per_block"),
    ({"threshold_tokens": -1}, "threshold_tokens"),
    ({"transfer_overhead_s": -0.1}, "transfer_overhead_s"),
    ({"sticky_load_gap": -1}, "sticky_load_gap"),
    ({"shutdown_grace_s": -1}, "shutdown_grace_s"),
    ({"soft_index_max_blocks": 0}, "soft_index_max_blocks"),
    ({"soft_index_max_blocks": 1 << 25}, "soft_index_max_blocks"),
    ({"max_cache_event_keys": 0}, "max_cache_event_keys"),
    ({"max_cache_event_keys": 100_000}, "max_cache_event_keys"),
])
def test_validate_names_the_field(overrides: dict[str, Any], field: str) -> None:
    exc = config_error(lambda: BrokerConfig(**overrides).validate(), field)
    assert isinstance(exc, InvalidArgument)
    # The same through load() (as flags): validation runs there too.
    config_error(lambda: BrokerConfig.load(overrides, env={}), field)


def test_validate_accepts_the_edges() -> None:
    BrokerConfig(leader_ttl_s=2, threshold_tokens=0, max_message_bytes=65536, min_ttl_s=5, max_ttl_s=5,
                 default_ttl_s=5, keepalive_interval_s=9.9, listen="[::1]:0", advertise="broker-0.svc:50051",
                 metrics_listen="").validate()
    BrokerConfig(store="memory", etcd_endpoint="not checked unless store=etcd").validate()


# ------------------------------------------------------------------------------------------ helpers


def test_parse_host_port() -> None:
    assert parse_host_port("127.0.0.1:50051", "listen") == ("127.0.0.1", 50051)
    assert parse_host_port("[::1]:0", "listen") == ("::1", 0)
    assert parse_host_port("broker.svc:1", "advertise") == ("broker.svc", 1)
    for bad in ("50051", ":1", "h:", "h:x", "h:-1", "h:65536"):
        config_error(lambda bad=bad: parse_host_port(bad, "etcd_endpoint"), "etcd_endpoint")


def test_derived_settings() -> None:
    config = BrokerConfig(listen="127.0.0.1:5000", max_block_keys=10, min_ttl_s=2, threshold_tokens=7,
                          sticky_load_gap=1.5)
    assert config.advertised == "127.0.0.1:5000"
    assert BrokerConfig(advertise="b:1").advertised == "b:1"
    assert config.replica.endswith(f"-{os.getpid()}") and BrokerConfig(replica_id="r1").replica == "r1"
    limits, placement = config.limits(), config.placement()
    assert (limits.max_block_keys, limits.min_ttl_s, limits.default_ttl_s) == (10, 2, 480.0)
    assert (placement.threshold_tokens, placement.sticky_load_gap) == (7, 1.5)
    limits = BrokerConfig(soft_index_max_blocks=9, max_cache_event_keys=3).limits()
    assert (limits.soft_index_max_blocks, limits.max_cache_event_keys) == (9, 3)
    assert (BrokerConfig().soft_index_max_blocks, BrokerConfig().max_cache_event_keys) == (65536, 4096)


def test_broker_defaults_are_the_cores_own() -> None:
    """One source for each limit and policy figure: a config left at its defaults builds the core's defaults."""
    from kvloop.broker.core import Limits, PlacementPolicy
    assert BrokerConfig().limits() == Limits() and BrokerConfig().placement() == PlacementPolicy()


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_binding_by_role_is_the_one_decision_kvloop_up_takes(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloop.engines.config import EngineConfig, role_cores
    for cpus in ({0, 1}, {0, 1, 2, 3}, {0}):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, cpus=cpus: cpus)
        bound = EngineConfig(role=role, model="m", omp_threads_bind="role").resolved_omp_threads_bind()
        everything = EngineConfig(role=role, model="m").resolved_omp_threads_bind()
        assert bound == (role_cores(role) if role_cores(role) != "auto" else everything), (role, cpus)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    halves = [EngineConfig(role=r, model="m", omp_threads_bind="role").resolved_omp_threads_bind()
              for r in ("prefill", "decode")]
    assert halves == ["0,1", "2,3"]


def test_kv_role_is_decided_by_role_in_one_place_unless_set() -> None:
    from kvloop.engines.config import KV_ROLE_OF_ROLE, EngineConfig
    for role, kv_role in KV_ROLE_OF_ROLE.items():
        assert EngineConfig(role=role, model="m").resolved_kv_role() == kv_role
    assert EngineConfig(role="decode", model="m", kv_role="kv_both").resolved_kv_role() == "kv_both"
    assert set(KV_ROLE_OF_ROLE.values()) == {"kv_producer", "kv_consumer", "kv_both"}


SIDECAR_ENV = {"KVLOOP_SIDECAR_ENGINE_ID": "e", "KVLOOP_SIDECAR_BROKER": "127.0.0.1:1",
               "KVLOOP_SIDECAR_SOCKET": "/tmp/s", "KVLOOP_SIDECAR_ENGINE_URL": "http://x:1",
               "KVLOOP_SIDECAR_LAYOUT_FINGERPRINT": "f"}


@pytest.mark.parametrize(("env", "field"), [
    ({"KVLOOP_SIDECAR_KV_EVENTS_ENDPOINT": "127.0.0.1:5557"}, "kv_events_endpoint"),
    ({"KVLOOP_SIDECAR_KV_EVENTS_REPLAY_ENDPOINT": "ipc:///tmp/r"}, "kv_events_replay_endpoint"),
    ({"KVLOOP_SIDECAR_KV_EVENTS_BATCH_KEYS": "0"}, "kv_events_batch_keys"),
    ({"KVLOOP_SIDECAR_KV_EVENTS_BATCH_KEYS": "5000"}, "kv_events_batch_keys"),
    ({"KVLOOP_SIDECAR_KV_EVENTS_BATCH_S": "0"}, "kv_events_batch_s"),
    ({"KVLOOP_SIDECAR_KV_EVENTS_MAX_BLOCKS": "0"}, "kv_events_max_blocks"),
])
def test_sidecar_kv_events_settings(env: dict[str, str], field: str) -> None:
    from kvloop.engines.sidecar.config import SidecarConfig

    config_error(lambda: SidecarConfig.load({}, env={**SIDECAR_ENV, **env}), field)
    ok = SidecarConfig.load({}, env={**SIDECAR_ENV, "KVLOOP_SIDECAR_KV_EVENTS_ENDPOINT": "tcp://engine:5557",
                                     "KVLOOP_SIDECAR_KV_EVENTS_REPLAY_ENDPOINT": "tcp://engine:5558"})
    assert (ok.kv_events_batch_keys, ok.kv_events_batch_s) == (512, 0.05)
