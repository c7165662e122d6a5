"""Bind checks: every service listens on loopback unless told otherwise, and refuses another address without
the credential that guards it (a token, a password); docs/architecture.md, "Trust boundaries".

Only an address that is provably loopback counts: "localhost", 127.0.0.0/8 and ::1 (bracketed or not). A
hostname, "" or 0.0.0.0 (every interface) may be reachable from elsewhere.
"""

from __future__ import annotations

import ipaddress


class UnsafeBindError(ValueError):
    """A service was asked to listen beyond loopback without its credential; the message says what to set."""


def is_loopback(host: str | None) -> bool:
    """Whether `host` is a loopback address (None and "" mean every interface: not loopback)."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost: not provably loopback


def check_bind(host: str | None, *, has_credential: bool, service: str, missing: str) -> None:
    """Raise UnsafeBindError for a non-loopback `host` unless `has_credential`.

    The message reads "refusing to serve {service} on {host} without {missing}"; `missing` says what to set.
    """
    if has_credential or is_loopback(host):
        return
    raise UnsafeBindError(f"refusing to serve {service} on {host or 'every address'} without {missing}")
