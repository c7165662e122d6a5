"""SSRF: which addresses a scrape target may reach, checked again before every scrape (DNS rebinding),
and the scrape connecting to the address that was checked. A fake resolver stands in for DNS."""

from __future__ import annotations

import http.server
import ipaddress
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
from sqlalchemy import Engine, insert, select

from collector.netpolicy import LOOPBACK_NETS, AddressPolicy, AddressRefusedError, ResolutionError, address_kind
from collector.schema import ScrapeTarget, SeriesPoint
from collector.scraper import Scraper

PAGE = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"


class _Exporter(http.server.BaseHTTPRequestHandler):
    hosts: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hosts.append(self.headers.get("Host", ""))
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def exporter_port() -> Iterator[int]:
    _Exporter.hosts = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


class FakeDns:
    def __init__(self, answer: list[str]) -> None:
        self.answer = answer
        self.lookups: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        if not self.answer:
            raise OSError("no such host")
        return list(self.answer)


def test_address_kinds() -> None:
    kinds = {
        "127.0.0.1": "loopback",
        "::1": "loopback",
        "::ffff:127.0.0.1": "loopback",
        "169.254.1.1": "link-local",
        "fe80::1": "link-local",
        "169.254.169.254": "cloud metadata",
        "fd00:ec2::254": "cloud metadata",
        "0.0.0.0": "unspecified",
        "::": "unspecified",
        "224.0.0.251": "multicast",
        "ff02::1": "multicast",
        "10.0.0.1": None,
        "192.168.1.10": None,
        "8.8.8.8": None,
    }
    assert {a: address_kind(ipaddress.ip_address(a)) for a in kinds} == kinds


def test_policy_resolves_checks_and_pins() -> None:
    dns = FakeDns(["127.0.0.1"])
    with pytest.raises(AddressRefusedError, match=r"loopback.*KVPILOT_SCRAPE_ALLOW_NETS"):
        AddressPolicy(resolve=dns).check_url("http://exporter.test:9400/metrics")
    allowed = AddressPolicy(LOOPBACK_NETS, resolve=dns)
    pinned = allowed.pin("http://exporter.test:9400/metrics?x=1")
    assert pinned.url == "http://127.0.0.1:9400/metrics?x=1" and pinned.headers == {"Host": "exporter.test:9400"}
    # A name with an allowed and a refused address keeps the allowed one; metadata is never allowed.
    dns.answer = ["169.254.169.254", "10.0.0.7"]
    assert allowed.pin("https://exporter.test/m").url == "https://10.0.0.7/m"
    assert allowed.pin("https://exporter.test/m").extensions == {"sni_hostname": "exporter.test"}
    dns.answer = ["169.254.169.254"]
    with pytest.raises(AddressRefusedError, match="metadata"):
        AddressPolicy((ipaddress.ip_network("169.254.0.0/16"),), resolve=dns).check_url("http://exporter.test/")
    dns.answer = []
    with pytest.raises(ResolutionError):
        allowed.check_url("http://nowhere.test/")


def _add_target(engine: Engine, url: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(ScrapeTarget.__table__).values(
                url=url, job="vllm", instance="vllm-0", interval_s=10.0, enabled=True, created_at=0.0, labels="{}"
            )
        )


def _running(engine: Engine) -> list[float]:
    sp = SeriesPoint.__table__
    with engine.connect() as conn:
        return list(conn.execute(select(sp.c.value).where(sp.c.name == "running")).scalars())


def _health(engine: Engine) -> tuple[bool, str | None]:
    t = ScrapeTarget.__table__
    with engine.connect() as conn:
        row = conn.execute(select(t.c.up, t.c.last_error)).one()
    return row.up, row.last_error


def test_the_scrape_connects_to_the_address_it_checked(db_engine: Engine, exporter_port: int) -> None:
    """`exporter.test` exists only in the fake DNS: the scrape can only succeed by connecting to the
    checked address, with the name in Host."""
    _add_target(db_engine, f"http://exporter.test:{exporter_port}/metrics")
    scraper = Scraper(db_engine, timeout_s=2.0, policy=AddressPolicy(LOOPBACK_NETS, resolve=FakeDns(["127.0.0.1"])))
    try:
        (outcome,) = scraper.run_once(now=1.0)
    finally:
        scraper.stop()
    assert outcome.up, outcome.error
    assert _running(db_engine) == [3.0]
    assert _Exporter.hosts == [f"exporter.test:{exporter_port}"]


def test_dns_rebinding_to_loopback_is_refused_at_scrape_time(db_engine: Engine, exporter_port: int) -> None:
    """The name resolved to a public address when the target was created; now it says 127.0.0.1."""
    dns = FakeDns(["93.184.216.34"])
    policy = AddressPolicy(resolve=dns)
    url = f"http://rebind.test:{exporter_port}/metrics"
    policy.check_url(url)  # what target creation does
    _add_target(db_engine, url)
    dns.answer = ["127.0.0.1"]
    scraper = Scraper(db_engine, timeout_s=2.0, policy=policy)
    try:
        (outcome,) = scraper.run_once(now=1.0)
    finally:
        scraper.stop()
    assert not outcome.up and outcome.error == "address not allowed"
    assert _health(db_engine) == (False, "address not allowed")  # the class only, no address
    assert _Exporter.hosts == []  # nothing was fetched
    assert dns.lookups == ["rebind.test", "rebind.test"]


def test_a_loopback_target_is_not_scraped_without_the_allow_list(db_engine: Engine, exporter_port: int) -> None:
    _add_target(db_engine, f"http://127.0.0.1:{exporter_port}/metrics")  # written around the API
    scraper = Scraper(db_engine, timeout_s=2.0)
    try:
        (outcome,) = scraper.run_once(now=1.0)
    finally:
        scraper.stop()
    assert outcome.error == "address not allowed" and _Exporter.hosts == []
