"""Only a provably loopback address may be served without a credential."""

from __future__ import annotations

import pytest

from plumbing.bind import UnsafeBindError, check_bind, is_loopback


def test_loopback_addresses() -> None:
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(a) for a in (None, "", "0.0.0.0", "::", "10.0.0.5", "dashboard.internal"))


def test_a_public_bind_needs_the_credential() -> None:
    check_bind("127.0.0.1", has_credential=False, service="the API", missing="a token")
    check_bind("0.0.0.0", has_credential=True, service="the API", missing="a token")
    with pytest.raises(UnsafeBindError, match="refusing to serve the API on every address without a token: set X"):
        check_bind("", has_credential=False, service="the API", missing="a token: set X")
    with pytest.raises(ValueError, match=r"on 10\.0\.0\.5 without"):
        check_bind("10.0.0.5", has_credential=False, service="the API", missing="a token")
