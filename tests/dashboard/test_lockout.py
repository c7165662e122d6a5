"""Sign-in lockout per client, with a rate bound on wrong passwords for the whole process.

Before, five wrong passwords from anyone locked everybody out for a minute, the right password included.
The guard is tested with an injected clock and sleep; the app with two browser sessions (AppTest).
"""

from __future__ import annotations

from typing import Any

import pytest

from dashboard import auth, settings
from dashboard.signin_guard import GuardLimits, SignInGuard, SignInRefused
from tests.dashboard.conftest import PASSWORD, no_exception, sign_in, texts
from tests.dashboard.seed import Seed


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


def guard(fake: FakeTime, **limits: Any) -> SignInGuard:
    return SignInGuard(GuardLimits(**limits), clock=fake.clock, sleep=fake.sleep)


def test_one_client_is_locked_and_nobody_else(fake: FakeTime) -> None:
    g = guard(fake)
    for _ in range(5):
        g.before_check("address 203.0.113.9")
        g.failed("address 203.0.113.9")
    with pytest.raises(SignInRefused, match="from you; try again in 60 s"):
        g.before_check("address 203.0.113.9")
    g.before_check("address 198.51.100.7")  # another client is checked at once
    assert fake.slept == []
    fake.now += 61
    g.before_check("address 203.0.113.9")  # the window has passed


def test_a_lock_counts_only_failures_inside_the_window(fake: FakeTime) -> None:
    g = guard(fake)
    for _ in range(4):
        g.failed("c")
    fake.now += 59
    g.failed("c")
    with pytest.raises(SignInRefused):
        g.before_check("c")
    fake.now += 2  # the first four are older than a minute now
    g.before_check("c")


def test_past_the_overall_bound_guesses_are_paced_but_the_right_one_gets_in(fake: FakeTime) -> None:
    g = guard(fake, overall=30, window_s=60.0, max_wait_s=10.0)
    for i in range(30):  # thirty addresses, one wrong guess each: nobody is locked
        g.before_check(f"address 10.0.0.{i}")
        g.failed(f"address 10.0.0.{i}")
    assert fake.slept == []
    g.before_check("address 192.0.2.1")  # the 31st check waits for its turn ...
    g.succeeded("address 192.0.2.1")  # ... and a right password is accepted after it
    g.before_check("address 192.0.2.2")
    assert fake.slept == [2.0]  # one check per window / overall = 2 s; the first turn was free


def test_the_overall_rate_holds_against_many_clients(fake: FakeTime) -> None:
    """An attacker with a new address for every guess, ten minutes long, with concurrent checks queued."""
    g = SignInGuard(GuardLimits(overall=30, window_s=60.0, max_wait_s=10.0), clock=fake.clock, sleep=lambda s: None)
    evaluated = refused = 0
    start = fake.now
    n = 0
    while fake.now - start < 600:
        n += 1
        try:
            g.before_check(f"address 10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}")
        except SignInRefused:
            refused += 1
        else:
            evaluated += 1
            g.failed(f"address 10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}")
        fake.now += 0.01  # a hundred guesses a second
    assert refused > 0
    assert evaluated <= 30 + 30 * 10 + 6  # the free first window, then 30 a minute (plus the queue)


def test_clients_remembered_are_bounded(fake: FakeTime) -> None:
    g = guard(fake, max_clients=100)
    for i in range(1000):
        g.failed(f"c{i}")
    assert len(g._clients) == 100


# --- who the client is --------------------------------------------------------------------------------


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    monkeypatch.setenv("KVPILOT_DASHBOARD_CLIENT_ADDRESS_HEADER", "X-Forwarded-For")
    monkeypatch.setattr(auth, "request_headers", lambda: {"X-Forwarded-For": "198.51.100.1, 203.0.113.5"})
    monkeypatch.setattr(auth, "client_address", lambda: "192.0.2.77")
    return monkeypatch


def test_the_proxy_header_names_the_client_on_loopback_only(proxied: pytest.MonkeyPatch) -> None:
    proxied.setattr(auth, "bind_address", lambda: "127.0.0.1")
    assert auth.client_key(settings.load()) == "address 203.0.113.5"  # what the proxy appended
    proxied.setattr(auth, "bind_address", lambda: "0.0.0.0")  # anyone could forge it there
    assert auth.client_key(settings.load()) == "address 192.0.2.77"


def test_the_header_is_ignored_unless_configured(proxied: pytest.MonkeyPatch) -> None:
    proxied.setattr(auth, "bind_address", lambda: "127.0.0.1")
    proxied.delenv("KVPILOT_DASHBOARD_CLIENT_ADDRESS_HEADER")
    assert auth.client_key(settings.load()) == "address 192.0.2.77"


def test_an_ipv6_client_is_its_64(proxied: pytest.MonkeyPatch) -> None:
    proxied.setattr(auth, "bind_address", lambda: "::")
    proxied.setattr(auth, "client_address", lambda: "2001:db8:1:2:aaaa::1")
    assert auth.client_key(settings.load()) == "address 2001:db8:1:2::/64"


# --- in the app ---------------------------------------------------------------------------------------


def test_a_locked_out_session_does_not_lock_out_another(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    mallory = open_page(seeded.url, "tuning")
    for _ in range(auth.MAX_FAILURES + 1):
        sign_in(mallory, "mallory", "guess-guess-guess")
    sign_in(mallory, "mallory", PASSWORD)
    no_exception(mallory)
    assert "too many failed sign-ins from you" in texts(mallory)
    alice = open_page(seeded.url, "tuning")  # another browser: the right password gets in
    sign_in(alice, "alice", PASSWORD)
    no_exception(alice)
    assert "Signed in as **alice**" in texts(alice)
