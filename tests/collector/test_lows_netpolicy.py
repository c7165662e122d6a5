"""IPv6 forms that carry an IPv4 address are judged by that address: `[::127.0.0.1]` is loopback.

Each transition format leads to 127.0.0.1 (or the metadata endpoint) on a host or gateway that speaks
it, while the IPv6 address itself is none of loopback, link-local...; a benign public address in each
form stays allowed.
"""

from __future__ import annotations

import ipaddress

import pytest
from fastapi.testclient import TestClient

from collector.netpolicy import LOOPBACK_NETS, AddressPolicy, AddressRefusedError, address_kind, embedded_ipv4
from collector.server import create_app
from collector.settings import CollectorSettings

LOOPBACK_FORMS = {
    "::127.0.0.1": "IPv4-compatible",
    "64:ff9b::7f00:1": "NAT64 well-known prefix",
    "64:ff9b:1:7f00:0:100::": "NAT64 local-use /48 (RFC 6052 /48 format)",
    "64:ff9b:1::7f00:1": "NAT64 local-use /48 (RFC 6052 /96 format)",
    "2002:7f00:1::": "6to4",
    "::ffff:0:7f00:1": "IPv4-translated",
    "::ffff:127.0.0.1": "IPv4-mapped",
    # Teredo: server 65.54.227.120, client 127.0.0.1 (stored inverted: 0x80ff_fffe)
    "2001:0:4136:e378:8000:63bf:80ff:fffe": "Teredo client",
}
PUBLIC_FORMS = ["::8.8.8.8", "64:ff9b::808:808", "2002:808:808::", "::ffff:0:808:808", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("literal", list(LOOPBACK_FORMS), ids=list(LOOPBACK_FORMS.values()))
def test_loopback_in_every_ipv6_form_is_loopback(literal: str) -> None:
    address = ipaddress.ip_address(literal)
    assert ipaddress.ip_address("127.0.0.1") in embedded_ipv4(address)
    assert address_kind(address) == "loopback"
    with pytest.raises(AddressRefusedError, match="loopback"):
        AddressPolicy().check_url(f"http://[{literal}]:9400/metrics")
    # allowing loopback on purpose allows it in these forms too
    AddressPolicy(LOOPBACK_NETS).check_url(f"http://[{literal}]:9400/metrics")


@pytest.mark.parametrize("literal", PUBLIC_FORMS)
def test_a_public_address_in_those_forms_is_allowed(literal: str) -> None:
    address = ipaddress.ip_address(literal)
    assert embedded_ipv4(address) == (ipaddress.ip_address("8.8.8.8"),)
    assert address_kind(address) is None
    AddressPolicy().check_url(f"http://[{literal}]:9400/metrics")


def test_nat64_local_use_judges_every_format_in_use() -> None:
    """The gateway's format is unknown: each format's field is judged, all-zero fields are not in use."""
    public = ipaddress.ip_address("64:ff9b:1::808:808")  # /96 format of 8.8.8.8
    assert ipaddress.ip_address("8.8.8.8") in embedded_ipv4(public) and address_kind(public) is None
    assert address_kind(ipaddress.ip_address("64:ff9b:1::")) == "unspecified"


def test_metadata_through_nat64_is_refused_even_when_allowed() -> None:
    policy = AddressPolicy((ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("64:ff9b::/96")))
    with pytest.raises(AddressRefusedError, match="metadata"):
        policy.check_url("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/")


def test_plain_ipv6_is_unchanged() -> None:
    assert embedded_ipv4(ipaddress.ip_address("::1")) == ()
    assert embedded_ipv4(ipaddress.ip_address("::")) == ()
    assert embedded_ipv4(ipaddress.ip_address("2606:4700::1111")) == ()
    assert address_kind(ipaddress.ip_address("::1")) == "loopback"


@pytest.mark.parametrize("literal", ["::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::", "::ffff:0:7f00:1"])
def test_the_target_api_refuses_them_with_a_422(sqlite_url: str, literal: str) -> None:
    settings = CollectorSettings(db_url=sqlite_url, ingest_token="i-tok", admin_token="a-tok", scrape_enabled=False)
    with TestClient(create_app(settings)) as client:
        answer = client.post(
            "/v1/targets",
            json={"url": f"http://[{literal}]:9400/metrics", "instance": "gpu-0"},
            headers={"Authorization": "Bearer a-tok"},
        )
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["loc"] == "url" and "loopback" in answer.text
