"""The dashboard's trust boundaries (docs/architecture.md): engine URLs from the settings only and nothing they answer
echoed; writes only for a signed-in user; loopback unless a password guards it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from collector.db import make_engine
from collector.schema import AlertSilence, Proposal
from dashboard import auth, settings
from plumbing.process import free_port
from tests.dashboard.conftest import APP, PASSWORD, metrics, no_exception, sign_in, texts
from tests.dashboard.seed import Seed

SECRET_BODY = "internal stack trace with db password hunter2"


class _Engine(BaseHTTPRequestHandler):
    """A stand-in engine: /admin/config answers 200 with a token, else 500 with a body that must not show."""

    seen: list[dict[str, str]] = []  # noqa: RUF012 - one list per test (cleared by the fixture)

    def do_GET(self) -> None:
        type(self).seen.append({"path": self.path, "authorization": self.headers.get("Authorization", "")})
        good = self.path == "/admin/config" and self.headers.get("Authorization") == "Bearer admin-s3cret"
        body = json.dumps({"config": {"scheduler": {"max_num_seqs": 80}}}) if good else SECRET_BODY
        self.send_response(200 if good else 500)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_engine() -> Iterator[str]:
    _Engine.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_admin_token_goes_only_to_a_configured_engine(fake_engine: str, monkeypatch) -> None:
    from dashboard.data import tuning

    monkeypatch.setenv("KVPILOT_DASHBOARD_ENGINES", f"a={fake_engine}")
    monkeypatch.setenv("KVPILOT_ADMIN_TOKEN", "admin-s3cret")
    assert tuning.running_config("a") == {"scheduler": {"max_num_seqs": 80}}
    assert _Engine.seen == [{"path": "/admin/config", "authorization": "Bearer admin-s3cret"}]
    # A URL is not a name: nothing a visitor could type reaches the network.
    with pytest.raises(tuning.DataUnavailable, match="no engine named"):
        tuning.running_config(f"{fake_engine}/evil")
    assert len(_Engine.seen) == 1


def test_what_an_engine_answers_is_never_shown(fake_engine: str, monkeypatch) -> None:
    from dashboard.data import tuning

    monkeypatch.setenv("KVPILOT_DASHBOARD_ENGINES", f"a={fake_engine}")
    monkeypatch.setenv("KVPILOT_ADMIN_TOKEN", "wrong")
    with pytest.raises(tuning.DataUnavailable) as caught:
        tuning.running_config("a")
    assert "HTTP 500" in str(caught.value) and "hunter2" not in str(caught.value)
    monkeypatch.setenv("KVPILOT_DASHBOARD_ENGINES", "a=http://127.0.0.1:9")
    with pytest.raises(tuning.DataUnavailable, match="unreachable"):
        tuning.running_config("a")


def test_the_tuning_page_offers_configured_engines_not_a_url_field(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_ENGINES", "a=http://127.0.0.1:9")
    at = open_page(seeded.url, "tuning")
    no_exception(at)
    assert not [t for t in at.text_input if "url" in (t.key or "").lower() or "URL" in t.label]
    assert at.selectbox(key="engine_pick").options == ["a · http://127.0.0.1:9"]
    assert "engine 'a' at http://127.0.0.1:9 is unreachable (ConnectError)." in texts(at)


@pytest.mark.parametrize(
    "value, problem",
    [
        ("a=ftp://x", "not an http(s) URL"),
        ("a=http://u:p@x:1", "no credentials"),
        ("a http://x", "not name=url"),
        ("a=http://x/?redirect=y", "no credentials, query or fragment"),
    ],
)
def test_engine_settings_refuse_what_is_not_a_plain_engine_url(value: str, problem: str) -> None:
    with pytest.raises(settings.SettingsError, match=re.escape(problem)):
        settings.parse_engines(value)
    assert settings.parse_engines(" a=http://h:8000/ , b=https://h2 ") == {"a": "http://h:8000", "b": "https://h2"}


def test_without_a_credential_the_dashboard_is_read_only(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "tuning")
    assert at.button(key="accept_2").disabled and at.button(key="reject_2").disabled
    assert "Read-only dashboard: to accept or reject proposals, sign in." in texts(at)
    at = open_page(seeded.url, "alerts")
    assert next(b for b in at.button if b.label == "Create silence").disabled
    assert at.button(key="silence_expire").disabled
    with pytest.raises(PermissionError):
        from dashboard.data import alerting

        alerting.create_silence(seeded.url, matchers=["a=b"], duration_s=60, created_by="", comment="")


def test_a_wrong_password_writes_nothing_and_repeated_failures_lock_sign_in(
    seeded: Seed, open_page, monkeypatch
) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = sign_in(open_page(seeded.url, "tuning"), "mallory", "guess-guess-guess")
    no_exception(at)
    assert "Not signed in: wrong password." in texts(at)
    assert at.button(key="accept_2").disabled
    for _ in range(auth.MAX_FAILURES):
        sign_in(at, "mallory", "guess-guess-guess")
    sign_in(at, "mallory", PASSWORD)  # even the right one waits now
    assert "too many failed sign-ins" in texts(at) and at.button(key="accept_2").disabled
    auth.FAILURES.clear()
    sign_in(at, "alice", PASSWORD)
    assert "Signed in as **alice**" in texts(at) and not at.button(key="accept_2").disabled
    at.button(key="accept_2").click().run()
    engine = make_engine(seeded.url)
    with engine.connect() as conn:
        assert conn.execute(select(Proposal.status).where(Proposal.id == 2)).scalar_one() == "accepted"
    engine.dispose()


def test_a_trusted_proxy_header_names_the_writer_on_loopback_only(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_TRUST_PROXY_HEADER", "X-Forwarded-User")
    monkeypatch.setattr(auth, "request_headers", lambda: {"X-Forwarded-User": "bob@example.com"})
    at = open_page(seeded.url, "alerts")
    no_exception(at)
    assert "Signed in as **bob@example.com** (via your proxy)." in texts(at)
    at.text_area(key="silence_matchers").set_value("alertname=KvCacheNearlyFull")
    next(b for b in at.button if b.label == "Create silence").click().run()
    no_exception(at)
    engine = make_engine(seeded.url)
    with engine.connect() as conn:
        authors = set(conn.execute(select(AlertSilence.created_by)).scalars())
    engine.dispose()
    assert "bob@example.com" in authors
    # Reachable by anyone (not loopback): a header anybody can send names nobody; the password is needed.
    monkeypatch.setattr(auth, "bind_address", lambda: "0.0.0.0")
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = open_page(seeded.url, "alerts")
    assert "sign in to see it" in texts(at) and not metrics(at)


def test_a_non_loopback_bind_without_a_password_shows_nothing(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setattr(auth, "bind_address", lambda: None)  # `streamlit run` without our config: all interfaces
    at = open_page(seeded.url)
    no_exception(at)
    assert "listens on every interface without a password, so it shows nothing" in texts(at)
    assert not metrics(at) and not at.dataframe


def test_a_non_loopback_bind_with_a_password_asks_every_reader_to_sign_in(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setattr(auth, "bind_address", lambda: "0.0.0.0")
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = open_page(seeded.url)
    assert "sign in to see it" in texts(at) and not metrics(at)
    sign_in(at, "dave")
    no_exception(at)
    assert metrics(at)["Requests"] == f"{len(seeded.requests):,}"


def test_kvpilot_dashboard_refuses_a_public_bind_without_a_password(monkeypatch) -> None:
    from kvpilot.cli import app
    from kvpilot.cli_dashboard import check_bind, dashboard_command

    monkeypatch.delenv("KVPILOT_DASHBOARD_PASSWORD", raising=False)
    result = CliRunner().invoke(app, ["dashboard", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert "refusing to serve the dashboard on 0.0.0.0 without a password" in result.output
    command = dashboard_command(port=8501, host="127.0.0.1", headless=True)
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    check_bind("127.0.0.1")
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    check_bind("0.0.0.0")  # guarded by the password: allowed
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", "short")
    with pytest.raises(ValueError, match="at least 12 characters"):
        check_bind("0.0.0.0")


@pytest.mark.timeout(90)
def test_streamlit_run_from_anywhere_listens_on_loopback(tmp_path: Path) -> None:
    """`streamlit run dashboard/app.py` (the entrypoint's docstring) takes dashboard/.streamlit/config.toml."""
    config = tomllib.loads((APP.parent / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(APP), "--server.port", str(port)],
        cwd=tmp_path,  # not the repository: no project-level config applies
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            seen += line
            if "URL:" in line:
                break
        assert f"http://127.0.0.1:{port}" in seen, seen
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_user_names_are_plain_text(monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    cfg = settings.load()
    assert auth.check_password(cfg, " Jean-Luc ", PASSWORD, client="test") == "Jean-Luc"
    for name in ("", "![x](http://evil/t.png)", "a\nb", "x" * 65):
        with pytest.raises(ValueError, match="give your name"):
            auth.check_password(cfg, name, PASSWORD, client="test")
    monkeypatch.setenv("KVPILOT_DASHBOARD_TRUST_PROXY_HEADER", "X-Forwarded-User")
    monkeypatch.setattr(auth, "request_headers", lambda: {"X-Forwarded-User": "[me](javascript:alert(1))"})
    assert auth._proxy_user(settings.load()) is None
