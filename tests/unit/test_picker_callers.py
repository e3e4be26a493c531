"""router/picker_callers.py: who may open an ext_proc stream on the endpoint picker."""

from __future__ import annotations

import pytest

from kvloop.router.config import RouterConfig
from kvloop.router.picker_callers import CallerCheck, nearest_uri
from kvloop.shared.errors import ConfigError

GATEWAY = "spiffe://cluster.local/ns/kvloop/sa/kvloop-inference-istio"
ISTIO_XFCC = (f'By=spiffe://cluster.local/ns/kvloop/sa/kvloop-picker;Hash=4f2a;Subject="";URI={GATEWAY}')


def test_the_uri_is_the_one_the_nearest_proxy_appended() -> None:
    assert nearest_uri(ISTIO_XFCC) == GATEWAY
    forged_first = f"URI={GATEWAY},{ISTIO_XFCC.replace(GATEWAY, 'spiffe://cluster.local/ns/x/sa/client')}"
    assert nearest_uri(forged_first) == "spiffe://cluster.local/ns/x/sa/client"


def test_a_quoted_subject_with_commas_and_semicolons_does_not_split_the_element() -> None:
    xfcc = f'Hash=1;Subject="CN=a,O=b;c";URI={GATEWAY}'
    assert nearest_uri(xfcc) == GATEWAY
    assert nearest_uri("") == ""
    assert nearest_uri("Hash=1;Subject=\"x\"") == ""


def test_the_token_or_a_listed_mesh_identity_is_let_in_and_nothing_else() -> None:
    check = CallerCheck(b"0123456789abcdef", [GATEWAY])
    assert check.refusal({"authorization": "Bearer 0123456789abcdef"}) == ""
    assert check.refusal({"x-forwarded-client-cert": ISTIO_XFCC}) == ""
    other = ISTIO_XFCC.replace(GATEWAY, "spiffe://cluster.local/ns/kvloop/sa/default")
    assert "ext_proc_mesh_callers" in check.refusal({"x-forwarded-client-cert": other})
    assert "ext_proc_token_file" in check.refusal({"authorization": "Bearer wrong"})
    assert not check.open


def test_without_mesh_callers_a_header_naming_a_gateway_proves_nothing() -> None:
    check = CallerCheck(b"0123456789abcdef")
    assert check.refusal({"x-forwarded-client-cert": ISTIO_XFCC}).startswith("authorization:")
    assert CallerCheck(None).open and CallerCheck(None).refusal({}) == ""


def test_the_config_takes_mesh_callers_instead_of_a_token_and_refuses_other_names() -> None:
    config = RouterConfig(broker="127.0.0.1:1", ext_proc_listen="127.0.0.1:0", ext_proc_mesh_callers=GATEWAY)
    config.validate()
    assert config.mesh_callers() == [GATEWAY]
    with pytest.raises(ConfigError, match="ext_proc_mesh_callers"):
        RouterConfig(broker="127.0.0.1:1", ext_proc_listen="127.0.0.1:0",
                     ext_proc_mesh_callers="kvloop-inference-istio").validate()
    with pytest.raises(ConfigError, match="ext_proc_token_file"):
        RouterConfig(broker="127.0.0.1:1", ext_proc_listen="127.0.0.1:0").validate()
