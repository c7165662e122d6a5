"""`kvpilot collector tokens ...`: named identities in the tokens file, and who owns which instances.

add / rotate print a secret once (the file keeps only its hash); list never shows one. Rotation: `rotate
NAME` adds a secret while the old ones stay valid, engines move to the new one, then `revoke NAME
--secret-id OLD` (or `rotate --expire-old-in`). The running collectors pick each change up on their next
request. owners / reassign read and change instance ownership in the database (an admin's repair, e.g.
for instances of a token nobody holds any more).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import typer

from collector import tokens
from collector.errors import CollectorError

tokens_app = typer.Typer(no_args_is_help=True, add_completion=False)

TokensFile = typer.Option(
    None, "--file", envvar="KVPILOT_TOKENS_FILE", help="the tokens file (KVPILOT_TOKENS_FILE)", show_default=False
)
DbUrl = typer.Option(None, "--db-url", help="database URL (default: KVPILOT_DB_URL or ./kvpilot-data/kvpilot.db)")


def _path(path: Path | None) -> Path:
    if path is None:
        typer.echo("kvpilot: --file: no tokens file; pass --file or set KVPILOT_TOKENS_FILE", err=True)
        raise typer.Exit(2)
    return path


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"kvpilot: {exc}", err=True)
    return typer.Exit(1)


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _show_secret(name: str, value: str, secret: tokens.Secret) -> None:
    typer.echo(f"identity {name}: new secret {secret.id} (shown once; the file keeps only its hash):", err=True)
    typer.echo(value)


@tokens_app.command("add")
def add_cmd(
    name: str = typer.Argument(..., help="identity name: what its instances are owned by"),
    role: list[str] = typer.Option(["ingest"], "--role", help="ingest, read or admin (repeat for several)"),
    file: Path = TokensFile,
) -> None:
    """Add an identity with one secret, printed once on stdout."""
    bad = [r for r in role if r not in tokens.ROLES]
    if bad:
        typer.echo(f"kvpilot: --role: {bad[0]!r} is not one of {', '.join(tokens.ROLES)}", err=True)
        raise typer.Exit(2)
    try:
        value, secret = tokens.add(_path(file), name, tuple(role))
    except CollectorError as exc:
        raise _fail(exc) from exc
    _show_secret(name, value, secret)


@tokens_app.command("rotate")
def rotate_cmd(
    name: str = typer.Argument(...),
    expire_old_in: float | None = typer.Option(
        None, "--expire-old-in", min=0.0, help="seconds the old secrets stay valid (default: until revoked)"
    ),
    file: Path = TokensFile,
) -> None:
    """Add a secret to NAME (printed once); the old ones stay valid until revoked or --expire-old-in."""
    try:
        value, secret = tokens.rotate(_path(file), name, old_expire_in_s=expire_old_in)
    except CollectorError as exc:
        raise _fail(exc) from exc
    _show_secret(name, value, secret)


@tokens_app.command("revoke")
def revoke_cmd(
    name: str = typer.Argument(...),
    secret_id: str | None = typer.Option(None, "--secret-id", help="revoke only this secret (see `list`)"),
    file: Path = TokensFile,
) -> None:
    """Revoke one secret of NAME, or (without --secret-id) the identity; its instances stay owned by NAME."""
    try:
        n = tokens.revoke(_path(file), name, secret_id=secret_id)
    except CollectorError as exc:
        raise _fail(exc) from exc
    what = f"secret {secret_id}" if secret_id else f"the identity and its {n} secret(s)"
    typer.echo(f"revoked {what} of {name}")


@tokens_app.command("list")
def list_cmd(file: Path = TokensFile) -> None:
    """Identities, roles and secret ids with their dates; never a secret or a hash."""
    try:
        identities = tokens.load(_path(file)).identities
    except CollectorError as exc:
        raise _fail(exc) from exc
    for name, entry in sorted(identities.items()):
        typer.echo(f"{name}  roles={','.join(entry.roles)}")
        for s in entry.secrets:
            typer.echo(f"  secret {s.id}  created {_when(s.created_at)}  expires {_when(s.expires_at)}")


@tokens_app.command("owners")
def owners_cmd(db_url: str = DbUrl) -> None:
    """Who owns how many instances (identity names, `target:<id>`, or `token:<fingerprint>` not adopted)."""
    from collector.owners import owner_counts

    engine = _engine(db_url)
    try:
        rows = owner_counts(engine)
    except CollectorError as exc:
        raise _fail(exc) from exc
    finally:
        engine.dispose()
    for owner, n in rows:
        typer.echo(f"{n:8d}  {owner}")


@tokens_app.command("reassign")
def reassign_cmd(
    from_owner: str = typer.Option(..., "--from", help="the current owner (see `owners`)"),
    to_name: str = typer.Option(..., "--to", help="the identity to own them"),
    instance: list[str] = typer.Option([], "--instance", help="only these instances (repeat; default: all)"),
    db_url: str = DbUrl,
) -> None:
    """Give instances of one owner to an identity (an admin's repair: a token nobody holds, a renamed engine)."""
    from collector.owners import reassign

    engine = _engine(db_url)
    try:
        n = reassign(engine, from_owner=from_owner, to_name=to_name, instances=instance or None)
    except CollectorError as exc:
        raise _fail(exc) from exc
    finally:
        engine.dispose()
    typer.echo(f"{n} instance(s) of {from_owner} now owned by {to_name}")


def _engine(db_url: str | None):
    from collector.db import check_schema_current, make_engine
    from collector.settings import CollectorSettings

    settings = CollectorSettings()
    engine = make_engine(db_url or settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
    try:
        check_schema_current(engine)
    except CollectorError as exc:
        engine.dispose()
        raise _fail(exc) from exc
    return engine
