"""Which addresses a scrape target may reach (SSRF), checked at creation and again before every scrape.

Whoever may add a scrape target could otherwise make the collector fetch what only the collector can
reach: its own loopback services, a cloud metadata endpoint (credentials), link-local devices. So a
target's host must resolve only to addresses that are none of loopback, link-local (169.254/16,
fe80::/10), unspecified (0.0.0.0, ::) or multicast, unless `KVPILOT_SCRAPE_ALLOW_NETS` names a network
holding them. An IPv6 address that embeds IPv4 addresses (mapped, compatible, NAT64, 6to4, Teredo) is
judged by those (`embedded_ipv4`). Cloud metadata endpoints (169.254.169.254, fd00:ec2::254, 100.100.100.200,
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


_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: the operator picks a prefix length in it
_LOCAL_PREFIX_LENGTHS = (48, 56, 64, 96)  # RFC 6052 2.2 formats that fit in the /48


def embedded_ipv4(address: Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address reaches through a transition format; () when it carries none.

    `[::127.0.0.1]` (IPv4-compatible), `[::ffff:127.0.0.1]` (mapped), `[::ffff:0:7f00:1]` (RFC 2765
    translated), `[64:ff9b::7f00:1]` (NAT64), `[2002:7f00:1::]` (6to4) and a Teredo address's client
    all lead to 127.0.0.1 on a host or gateway that speaks the format, while the IPv6 address itself
    is none of loopback, link-local... So the policy judges these by the IPv4 addresses they carry.
    """
    if not isinstance(address, ipaddress.IPv6Address):
        return ()
    value = int(address)
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    elif value >> 32 == 0xFFFF_0000 or (value >> 32 == 0 and value > 1):  # translated; compatible (not :: or ::1)
        found.append(ipaddress.IPv4Address(value & 0xFFFF_FFFF))
    if address in _NAT64_WELL_KNOWN:
        found.append(ipaddress.IPv4Address(value & 0xFFFF_FFFF))
    elif address in _NAT64_LOCAL:
        packed = address.packed
        without_u = packed[:8] + packed[9:]  # RFC 6052: bits 64..71 (the "u" octet) hold no address bits
        # The format is the gateway's configuration, unknown here: every format's address is judged, but
        # a format whose field is all zeros is not the one in use (unless all are: then it is 0.0.0.0).
        fields = [packed[12:] if n == 96 else without_u[n // 8 : n // 8 + 4] for n in _LOCAL_PREFIX_LENGTHS]
        found.extend(ipaddress.IPv4Address(f) for f in fields if any(f) or not any(map(any, fields)))
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.append(address.teredo[1])
    return tuple(dict.fromkeys(found))


def _judged(address: Address) -> tuple[Address, ...]:
    """The addresses the policy decides on: the IPv4 addresses an IPv6 address embeds, else itself."""
    return embedded_ipv4(address) or (address,)


def _own_kind(address: Address) -> str | None:
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


def address_kind(address: Address) -> str | None:
    """Why an address is refused by default (None: it is not); metadata first, as it is never allowed."""
    kinds = [kind for form in _judged(address) if (kind := _own_kind(form)) is not None]
    if "cloud metadata" in kinds:
        return "cloud metadata"
    return kinds[0] if kinds else None


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
        """Refuse `address` unless every address it is judged by is harmless or in an allowed network."""
        if address_kind(address) == "cloud metadata":
            raise AddressRefusedError("the host is a cloud metadata address, which is never scraped")
        refused = [
            kind
            for form in _judged(address)
            if (kind := _own_kind(form)) is not None and not any(form in net for net in self.allow_nets)
        ]
        if not refused:
            return
        kind = refused[0]
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
