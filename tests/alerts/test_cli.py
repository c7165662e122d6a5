"""`kvpilot alerts` exit codes and messages."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvpilot.cli import app

HERE = Path(__file__).parent
runner = CliRunner()


def test_alerts_test_exit_codes(tmp_path):
    ok = runner.invoke(app, ["alerts", "test", str(HERE / "rules" / "scheduler_blocked_test.yml")])
    assert ok.exit_code == 0 and "SUCCESS" in ok.output
    bad = tmp_path / "bad_test.yml"
    text = (
        (HERE / "rules" / "scheduler_blocked_test.yml")
        .read_text()
        .replace("../../../alerts", str(HERE.parent.parent / "alerts"))
        .replace("eval_time: 1m,", "eval_time: 3m,")
    )
    bad.write_text(text)
    failed = runner.invoke(app, ["alerts", "test", str(bad)])
    assert failed.exit_code == 1 and "FAILED" in failed.output and "time: 3m" in failed.output


def test_check_rejects_bad_file(tmp_path):
    bad = tmp_path / "r.yml"
    bad.write_text("groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: queue_depth >> 1\n")
    result = runner.invoke(app, ["alerts", "check", str(bad)])
    assert result.exit_code == 1 and "r.yml:5:" in result.output


def test_export_to_file(tmp_path):
    out = tmp_path / "p.yml"
    result = runner.invoke(app, ["alerts", "export-prometheus", "--out", str(out)])
    assert result.exit_code == 0 and "kvpilot_queue_depth" in out.read_text()


def test_silence_roundtrip(sqlite_url):
    added = runner.invoke(
        app, ["alerts", "silence", "add", "alertname=MemoryPressure", "--db", sqlite_url, "--duration", "1h"]
    )
    assert added.exit_code == 0, added.output
    silence_id = added.output.strip().splitlines()[-1]
    listed = runner.invoke(app, ["alerts", "silence", "list", "--db", sqlite_url])
    assert silence_id in listed.output
    assert runner.invoke(app, ["alerts", "silence", "expire", silence_id, "--db", sqlite_url]).exit_code == 0
    assert silence_id not in runner.invoke(app, ["alerts", "silence", "list", "--db", sqlite_url]).output
    bad = runner.invoke(app, ["alerts", "silence", "add", "no-operator", "--db", sqlite_url])
    assert bad.exit_code == 2 and "bad matcher" in bad.output


def test_run_serves_the_api(sqlite_url):
    """`kvpilot alerts run --api-port`: silences posted over HTTP are what `kvpilot alerts silence list` shows."""
    import threading
    import time

    import httpx

    from alerts.alertmanager import rfc3339
    from plumbing.process import ProcessStartError, free_port, wait_healthy

    port = free_port()
    done: dict = {}
    thread = threading.Thread(
        target=lambda: done.setdefault(
            "result",
            runner.invoke(
                app,
                [
                    "alerts",
                    "run",
                    "--db",
                    sqlite_url,
                    "--api-port",
                    str(port),
                    "--api-token",
                    "tok",
                    "--duration-s",
                    "3",
                ],
            ),
        )
    )
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/-/healthy", None, timeout_s=10, what="kvpilot alerts run", poll_s=0.05)
    except ProcessStartError as exc:
        raise AssertionError(done) from exc
    now = time.time()
    body = {
        "matchers": [{"name": "alertname", "value": "MemoryPressure", "isRegex": False}],
        "startsAt": rfc3339(now),
        "endsAt": rfc3339(now + 600),
        "createdBy": "api",
        "comment": "via HTTP",
    }
    assert httpx.post(f"{url}/api/v2/silences", json=body, timeout=5).status_code == 401
    created = httpx.post(f"{url}/api/v2/silences", json=body, headers={"Authorization": "Bearer tok"}, timeout=5)
    silence_id = created.json()["silenceID"]
    thread.join(15)
    assert not thread.is_alive() and done["result"].exit_code == 0, done["result"].output
    assert silence_id in runner.invoke(app, ["alerts", "silence", "list", "--db", sqlite_url]).output
