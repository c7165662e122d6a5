"""Who a bearer token is: the collector's identities, from the tokens file and the two environment tokens.

`KVPILOT_INGEST_TOKEN` and `KVPILOT_ADMIN_TOKEN` keep working as before: each is one more secret of
the identity named `ingest` (role ingest) or `admin` (role admin), which the tokens file may also define
(its secrets are then valid next to the environment's, which is how a deployment moves from the
environment token to the file without its engines losing their instances). A collector with no
identity that may push (no ingest token, no ingest identity in the file: loopback development only)
takes pushes as `ingest`, so setting a token later keeps those instances with their pushers.

The file is re-read when it changes (size, times or inode: an atomic rename always makes a new inode),
which one stat per authenticated request tells (a few microseconds), so a secret added by `kvpilot
collector tokens rotate` works on the next request and a revoked one stops at once, on every collector
that reads the file. A file that fails to parse is logged and counted, and the identities loaded last
stay in force.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from collector import tokens
from collector.errors import CollectorError

log = logging.getLogger("kvpilot.collector")


@dataclass(frozen=True)
class Identity:
    name: str
    roles: frozenset[str]

    def may(self, role: str) -> bool:
        """ingest and admin may read as well."""
        return role in self.roles or (role == "read" and bool(self.roles))


@dataclass(frozen=True)
class _Key:
    sha256: bytes
    identity: Identity
    expires_at: float | None


class IdentityStore:
    """The identities in force: the environment tokens plus the tokens file, re-read when it changes."""

    def __init__(
        self,
        *,
        ingest_token: str | None = None,
        admin_token: str | None = None,
        tokens_file: Path | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._env = [(t, tokens.IMPLICIT_INGEST, "ingest") for t in [ingest_token] if t is not None]
        self._env += [(t, tokens.IMPLICIT_ADMIN, "admin") for t in [admin_token] if t is not None]
        self.path = tokens_file
        self.clock = clock
        self._lock = threading.Lock()
        self._stamp: tuple[int, ...] | None = None
        self._keys: tuple[_Key, ...] = ()
        self._idents: dict[str, Identity] = {}
        self._file = tokens.TokensFile()
        self.reloads = Counter(
            "kvpilot_collector_tokens_reloads",
            "tokens file loads: ok, or failed (the identities loaded before stay in force)",
            ["result"],
            registry=registry,
        )
        for result in ("ok", "failed"):
            self.reloads.labels(result)
        self._refresh(force=True, strict=True)

    # --- what the file and the environment say ---------------------------------------------------------

    def _build(self, file: tokens.TokensFile) -> tuple[_Key, ...]:
        roles: dict[str, set[str]] = {name: set(entry.roles) for name, entry in file.identities.items()}
        for _, name, role in self._env:
            roles.setdefault(name, set()).add(role)
        idents = {name: Identity(name, frozenset(r)) for name, r in roles.items()}
        keys = [_Key(bytes.fromhex(tokens.hash_secret(t)), idents[name], None) for t, name, _ in self._env]
        for name, entry in file.identities.items():
            keys += [_Key(bytes.fromhex(s.sha256), idents[name], s.expires_at) for s in entry.secrets]
        return tuple(keys)

    def _refresh(self, *, force: bool = False, strict: bool = False) -> None:
        """Re-read the file if it changed. `strict` (startup): a broken file raises instead of being logged."""
        file = self._file
        if self.path is not None:
            problem: tokens.TokensFileError | None = None
            try:
                st = os.stat(self.path)
                stamp: tuple[int, ...] | None = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            except FileNotFoundError:
                stamp = None
            except OSError as exc:
                stamp = (-1, exc.errno or 0)
                problem = tokens.TokensFileError(f"tokens file {self.path}: {exc.strerror or exc}")
            if stamp == self._stamp and not force:
                return
            self._stamp = stamp  # a broken file is reported once, not on every request, until it changes
            try:
                if problem is not None:
                    raise problem
                file = tokens.load(self.path)
            except tokens.TokensFileError as exc:
                self._failed(exc, strict)
                return
            if not force:
                log.info("tokens file %s reloaded: %d identities", self.path, len(file.identities))
            self.reloads.labels("ok").inc()
        self._file = file
        self._keys = self._build(file)
        self._idents = {k.identity.name: k.identity for k in self._keys}
        for name, entry in file.identities.items():  # an identity whose secrets were all revoked
            self._idents.setdefault(name, Identity(name, frozenset(entry.roles)))

    def _failed(self, exc: CollectorError, strict: bool) -> None:
        self.reloads.labels("failed").inc()
        if strict:
            raise exc
        log.error("%s; the identities loaded before stay in force", exc)

    # --- the questions the server asks ------------------------------------------------------------------

    def authenticate(self, presented: str) -> Identity | None:
        """The identity whose live secret this is, or None. Every key is compared (constant time each)."""
        digest = bytes.fromhex(tokens.hash_secret(presented))
        with self._lock:
            self._refresh()
            return self._match(digest)

    def _match(self, digest: bytes) -> Identity | None:
        now = self.clock()
        found = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.sha256) and (key.expires_at is None or now < key.expires_at):
                found = key.identity
        return found

    def identities(self) -> dict[str, Identity]:
        with self._lock:
            self._refresh()
            return self._idents

    @property
    def pushes_open(self) -> bool:
        """No ingest token and no tokens file: pushes need no token (loopback only, `check_bind_safety`).
        Decided by configuration, never by the file's contents: revoking every secret closes, not opens."""
        return self.path is None and not any(name == tokens.IMPLICIT_INGEST for _, name, _ in self._env)

    @property
    def reads_open(self) -> bool:
        """No credential configured at all: listing targets needs no token, as on a token-less collector."""
        return self.path is None and not self._env

    def has_admin(self) -> bool:
        """Whether any identity holds the admin role (even one whose secrets were all revoked)."""
        return any("admin" in ident.roles for ident in self.identities().values())

    def legacy_owners(self) -> dict[str, str]:
        """`token:<fingerprint>` of every known secret -> its identity's name (`collector.owners.adopt`)."""
        with self._lock:
            return {tokens.legacy_owner(k.sha256.hex()): k.identity.name for k in self._keys}
