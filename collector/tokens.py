"""The tokens file (KVPILOT_TOKENS_FILE): named identities, their roles and the hashes of their secrets.

An engine's identity is a name, not a secret: instances belong to the name (`collector.claims`), so a
secret can rotate without the engine losing them. An identity holds several secrets at once (a
rotation adds one, the old one stays valid until revoked or until its `expires_at`), each kept as the
SHA-256 of the secret, never the secret. A fast unsalted hash is enough because every secret is 256
random bits made by `new_secret` (no dictionary to try); it also lets the collector recognise the
fingerprints that older versions stored as owners (`legacy_owner`) and adopt them.

Roles: `ingest` (push events and spans), `admin` (administer scrape targets), `read` (list targets,
/metrics when not public); ingest and admin may read too.

The file is JSON, edited only through `kvpilot collector tokens` (`edit`: under a lock, written to a
temporary file, fsynced and renamed over the old one, so a collector reading it sees the old or the new
file, never half of one). The collector re-reads it when it changes (`collector.identities`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from collector.errors import CollectorError

Role = Literal["ingest", "read", "admin"]
ROLES: tuple[str, ...] = ("ingest", "read", "admin")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"  # no ':' so a name never looks like `target:1`/`token:ab`
IMPLICIT_INGEST = "ingest"  # KVPILOT_INGEST_TOKEN's identity (and the pushers of a collector without one)
IMPLICIT_ADMIN = "admin"  # KVPILOT_ADMIN_TOKEN's identity
ENV_SECRET_ID = "env"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class TokensFileError(CollectorError):
    """The tokens file cannot be read, parsed or changed; the message names the file and the field."""


class Secret(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, Field(pattern=r"^[0-9a-f]{8}$")]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    created_at: float
    expires_at: float | None = None

    def valid_at(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


class IdentityEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    roles: Annotated[tuple[Role, ...], Field(min_length=1)]
    secrets: tuple[Secret, ...] = ()

    @field_validator("roles")
    @classmethod
    def _sorted_roles(cls, roles: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(roles), key=ROLES.index))


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    identities: dict[Name, IdentityEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_secrets(self) -> TokensFile:
        seen: set[str] = set()
        for name, entry in self.identities.items():
            ids = [s.id for s in entry.secrets]
            if len(set(ids)) != len(ids):
                raise ValueError(f"identities.{name}.secrets: secret ids repeat")
            for secret in entry.secrets:
                if secret.sha256 in seen:
                    raise ValueError(f"identities.{name}.secrets: a secret is listed twice")
                seen.add(secret.sha256)
        return self


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def legacy_owner(sha256_hex: str) -> str:
    """The owner older versions stored for a token with this hash (`token:` + 16 hex digits)."""
    return "token:" + sha256_hex[:16]


def new_secret() -> tuple[str, Secret]:
    """A fresh secret (shown once) and its entry (what the file keeps)."""
    value = "kvp_" + secrets.token_urlsafe(32)
    return value, Secret(id=secrets.token_hex(4), sha256=hash_secret(value), created_at=time.time())


def check_name(name: str) -> str:
    if not re.fullmatch(NAME_PATTERN, name):
        raise TokensFileError(
            f"identity name {name!r}: 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def load(path: Path) -> TokensFile:
    """The file's identities; a missing file is an empty one (the first `tokens add` makes it)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return TokensFile()
    except OSError as exc:
        raise TokensFileError(f"tokens file {path}: {exc.strerror or exc}") from exc
    try:
        return TokensFile.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(file)"
        raise TokensFileError(f"tokens file {path}: {loc}: {err['msg']}") from exc


def save(path: Path, tokens: TokensFile) -> None:
    """Atomically replace `path` (mode 0600): a reader sees the old file or the new one, whole."""
    text = json.dumps(tokens.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def edit(path: Path) -> Iterator[dict[str, IdentityEntry]]:
    """Read-modify-write under an exclusive lock (two CLI runs at once cannot lose each other's change);
    the identities yielded are saved when the block ends without an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        identities = dict(load(path).identities)
        yield identities
        try:
            updated = TokensFile(identities=identities)
        except ValidationError as exc:
            raise TokensFileError(f"tokens file {path}: {exc.errors()[0]['msg']}") from exc
        save(path, updated)


def add(path: Path, name: str, roles: tuple[str, ...]) -> tuple[str, Secret]:
    """A new identity with one secret; refused if the name exists (rotate it instead)."""
    check_name(name)
    with edit(path) as identities:
        if name in identities:
            raise TokensFileError(f"identity {name!r} exists in {path}; use `rotate {name}` for a new secret")
        value, secret = new_secret()
        identities[name] = IdentityEntry(roles=roles, secrets=(secret,))
    return value, secret


def rotate(path: Path, name: str, *, old_expire_in_s: float | None = None) -> tuple[str, Secret]:
    """A new secret for `name`; the old ones stay valid (until revoked, or `old_expire_in_s` from now)."""
    with edit(path) as identities:
        entry = _existing(path, identities, name)
        value, secret = new_secret()
        old = entry.secrets
        if old_expire_in_s is not None:
            deadline = time.time() + old_expire_in_s
            old = tuple(
                s.model_copy(update={"expires_at": min(deadline, s.expires_at or deadline)}) for s in entry.secrets
            )
        identities[name] = entry.model_copy(update={"secrets": (*old, secret)})
    return value, secret


def revoke(path: Path, name: str, *, secret_id: str | None = None) -> int:
    """Remove one secret of `name`, or (without `secret_id`) the identity itself; returns the secrets removed.
    Its instances stay owned by the name: adding the name again gets them back."""
    with edit(path) as identities:
        entry = _existing(path, identities, name)
        if secret_id is None:
            del identities[name]
            return len(entry.secrets)
        kept = tuple(s for s in entry.secrets if s.id != secret_id)
        if len(kept) == len(entry.secrets):
            ids = ", ".join(s.id for s in entry.secrets) or "none"
            raise TokensFileError(f"identity {name!r} has no secret {secret_id!r} (its secrets: {ids})")
        identities[name] = entry.model_copy(update={"secrets": kept})
        return 1


def _existing(path: Path, identities: dict[str, IdentityEntry], name: str) -> IdentityEntry:
    entry = identities.get(name)
    if entry is None:
        known = ", ".join(sorted(identities)) or "none"
        raise TokensFileError(f"no identity {name!r} in {path} (known: {known})")
    return entry
