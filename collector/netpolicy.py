"""Which addresses a scrape target may reach (SSRF), checked at creation and again before every scrape.

Whoever may add a scrape target could otherwise make the collector fetch what only the collector can
reach: its own loopback services, a cloud metadata endpoint (credentials), link-local devices. So a
target's host must resolve only to addresses that are none of loopback, link-local (169.254/16,
fe80::/10), unspecified (0.0.0.0, ::) or multicast, unless `KVPILOT_SCRAPE_ALLOW_NETS` names a network
holding them. Cloud metadata endpoints (169.254.169.254, fd00:ec2::254, 100.100.100.200,
metadata.google.internal) are refused even then: nothing kvpilot scrapes lives there.

DNS rebinding: a name that resolved to a public address when the target was created may resolve to
127.0.0.1 at scrape time. `AddressPolicy.pin` resolves, checks every address, and returns the URL with
the checked address in place of the name (Host header and TLS SNI keep the name), so the connection goes
to the address that was checked, not to whatever a second lookup returns.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import httpx

from collector.errors import CollectorError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "169.254.170.2")
)
LOOPBACK_NETS: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_DNS_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvpilot-dns")


class AddressRefusedError(CollectorError):
    """A target's host is, or resolves to, an address the policy refuses; the message names the kind."""


class ResolutionError(CollectorError):
    """A target's host does not resolve (or not within the deadline)."""


def system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _plain(address: Address) -> Address:
    """IPv4-mapped IPv6 (::ffff:127.0.0.1) is the IPv4 address it maps."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def address_kind(address: Address) -> str | None:
    """Why an address is refused by default (None: it is not)."""
    address = _plain(address)
    if address in METADATA_ADDRESSES:
        return "cloud metadata"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    return None


@dataclass(frozen=True)
class Pinned:
    """One request to make: the URL with the checked address, and the name in Host (and SNI)."""

    url: str
    headers: dict[str, str]
    extensions: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AddressPolicy:
    """Resolve-and-check of target URLs; `resolve` is injected in tests (a fake DNS)."""

    allow_nets: Sequence[Network] = ()
    resolve: Resolver = system_resolve

    @classmethod
    def from_strings(cls, nets: Iterable[str], resolve: Resolver = system_resolve) -> AddressPolicy:
        return cls(tuple(ipaddress.ip_network(n, strict=False) for n in nets), resolve)

    def check_address(self, address: Address) -> None:
        kind = address_kind(address)
        if kind is None:
            return
        if kind == "cloud metadata":
            raise AddressRefusedError("the host is a cloud metadata address, which is never scraped")
        if any(_plain(address) in net for net in self.allow_nets):
            return
        article = "an" if kind[0] in "aeiou" else "a"
        raise AddressRefusedError(
            f"the host resolves to {article} {kind} address; allow its network with KVPILOT_SCRAPE_ALLOW_NETS"
        )

    def addresses(self, host: str, port: int, *, timeout_s: float = 5.0) -> list[Address]:
        """The addresses of `host` the policy allows, in resolver order; AddressRefusedError if none is.

        A name with an allowed and a refused address (localhost: 127.0.0.1 and ::1, with only 127.0.0.0/8
        allowed) keeps the allowed one: `pin` connects to a checked address, never to the name."""
        name = host.strip("[]").rstrip(".").lower()
        if name in METADATA_HOSTS:
            raise AddressRefusedError("the host is a cloud metadata endpoint, which is never scraped")
        try:
            literal: Address | None = ipaddress.ip_address(name)
        except ValueError:
            literal = None
        if literal is not None:
            found = [literal]
        else:
            try:
                names = _DNS_POOL.submit(self.resolve, name, port).result(timeout=timeout_s)
            except FutureTimeout as exc:
                raise ResolutionError("the host did not resolve in time") from exc
            except (OSError, UnicodeError) as exc:
                raise ResolutionError("the host does not resolve") from exc
            found = [ipaddress.ip_address(a.split("%", 1)[0]) for a in names]
            if not found:
                raise ResolutionError("the host does not resolve")
        allowed: list[Address] = []
        refusal: AddressRefusedError | None = None
        for address in found:
            try:
                self.check_address(address)
            except AddressRefusedError as exc:
                refusal = refusal or exc
            else:
                allowed.append(address)
        if not allowed and refusal is not None:
            raise refusal
        return allowed

    def check_url(self, url: str, *, timeout_s: float = 5.0) -> None:
        parsed = httpx.URL(url)
        self.addresses(parsed.host, parsed.port or _default_port(parsed.scheme), timeout_s=timeout_s)

    def pin(self, url: str, *, timeout_s: float = 5.0) -> Pinned:
        """Resolve and check `url`'s host; the request to make goes to the first checked address."""
        parsed = httpx.URL(url)
        port = parsed.port or _default_port(parsed.scheme)
        address = self.addresses(parsed.host, port, timeout_s=timeout_s)[0]
        host_header = parsed.netloc.decode("ascii")
        extensions = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
        return Pinned(str(parsed.copy_with(host=str(address))), {"Host": host_header}, extensions)


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80
