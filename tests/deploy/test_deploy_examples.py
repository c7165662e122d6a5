"""The deployment example in deploy/ runs as written: every ExecStart is a kvpilot command whose options and
values the CLI accepts, every KVPILOT_ variable is one kvpilot reads, systemd accepts the units
(`systemd-analyze verify`, where it is installed) and the load balancer's pool is the collectors' ports."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from kvpilot.cli import app

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
HAPROXY = ROOT / "deploy" / "haproxy" / "kvpilot.cfg"
VENV_KVPILOT = "/srv/kvpilot/.venv/bin/kvpilot"
INSTANCES = {"kvpilot-collector@": "8101", "kvpilot-alerts@": "9093"}  # what the units' comments enable
RUNTIME_PACKAGES = ("collector", "alerts", "dashboard", "engine", "tuner", "kvpilot", "integrations", "plumbing")


def _units() -> list[Path]:
    return sorted(p for p in SYSTEMD.rglob("*") if p.suffix in {".service", ".timer", ".conf"})


def _assignments(path: Path) -> list[tuple[str, str]]:
    """(key, value) of a unit file, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def _exec_starts() -> list[tuple[Path, list[str]]]:
    found = []
    for path in _units():
        instance = next((i for prefix, i in INSTANCES.items() if path.name.startswith(prefix)), "")
        for key, value in _assignments(path):
            if key == "ExecStart":
                found.append((path, shlex.split(value.replace("%i", instance))))
    return found


class UsageProblem(Exception):
    """What the CLI would have answered with exit 2 (typer's click is private: read off its exception)."""


def _resolve(argv: list[str]) -> typer.Context:
    """Parse argv down the CLI's command tree the way the real CLI would, without running the command."""
    command = typer.main.get_command(app)
    names = ["kvpilot"]
    while hasattr(command, "get_command"):  # a group
        sub = command.get_command(typer.Context(command), argv[0])
        assert sub is not None, f"kvpilot {' '.join(names[1:])}: no command {argv[0]!r}"
        names.append(argv.pop(0))
        command = sub
    try:
        return command.make_context(" ".join(names), list(argv))
    except Exception as exc:
        if getattr(exc, "exit_code", None) == 2 and hasattr(exc, "format_message"):
            raise UsageProblem(exc.format_message()) from exc
        raise


def test_every_exec_start_is_a_kvpilot_command_the_cli_accepts() -> None:
    starts = _exec_starts()
    assert {p.name for p, _ in starts} >= {
        "kvpilot-collector@.service",
        "kvpilot-alerts@.service",
        "kvpilot-dashboard.service",
        "kvpilot-db-upgrade.service",
        "kvpilot-nightly.service",
        "kvpilot-nightly-vllm.service",
        "kvpilot-prune.service",
    }
    for path, argv in starts:
        assert argv[0] == VENV_KVPILOT, f"{path.name}: {argv[0]}"
        try:
            ctx = _resolve(argv[1:])
        except UsageProblem as exc:
            pytest.fail(f"{path.name}: {exc}")
        assert ctx.params, path.name


def test_a_wrong_option_or_value_in_an_exec_start_would_be_caught() -> None:
    with pytest.raises(UsageProblem, match="--prot"):
        _resolve(["collector", "serve", "--prot", "8101"])
    with pytest.raises(UsageProblem, match="--port"):
        _resolve(["collector", "serve", "--port", "%i"])  # an instance name that is not a port
    with pytest.raises(AssertionError, match="no command 'serv'"):
        _resolve(["collector", "serv"])


def _kvpilot_names_in_code() -> set[str]:
    from collector.settings import CollectorSettings

    names = {f"KVPILOT_{field.upper()}" for field in CollectorSettings.model_fields}
    for package in RUNTIME_PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"KVPILOT_[A-Z0-9_]+", source.read_text()))
    return names


def test_every_kvpilot_variable_in_the_example_is_one_kvpilot_reads() -> None:
    known = _kvpilot_names_in_code()
    used: dict[str, str] = {}
    for path in [*_units(), SYSTEMD / "kvpilot.env"]:
        pairs = _assignments(path)
        if path.suffix == ".env":
            pairs = [("Environment", f"{k}={v}") for k, v in pairs]
        for key, value in pairs:
            if key == "Environment":
                name = value.split("=", 1)[0]
                used[name] = path.name
    assert {"KVPILOT_DB_URL", "KVPILOT_TOKENS_FILE", "KVPILOT_SCRAPE_ENABLED"} <= set(used)
    unknown = {name: where for name, where in used.items() if name.startswith("KVPILOT_") and name not in known}
    assert not unknown, f"variables kvpilot never reads: {unknown}"


def test_exactly_one_collector_scrapes_and_the_balancer_pool_is_the_collectors() -> None:
    template = dict(_assignments(SYSTEMD / "kvpilot-collector@.service"))
    assert template["Environment"] == "KVPILOT_SCRAPE_ENABLED=false"
    drop_ins = list(SYSTEMD.glob("kvpilot-collector@*.service.d/*.conf"))
    assert [d.parent.name for d in drop_ins] == ["kvpilot-collector@8101.service.d"]
    assert ("Environment", "KVPILOT_SCRAPE_ENABLED=true") in _assignments(drop_ins[0])

    cfg = HAPROXY.read_text()
    servers = re.findall(r"^\s*server\s+\S+\s+127\.0\.0\.1:(\d+)\s.*\bcheck\b", cfg, flags=re.M)
    assert servers == ["8101", "8102", "8103"]
    assert "option httpchk GET /health" in cfg
    assert (
        "kvpilot-collector@8101 kvpilot-collector@8102 kvpilot-collector@8103"
        in (SYSTEMD / "kvpilot-collector@.service").read_text()
    )


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd); the units' syntax is not checked")
    kvpilot = Path(sys.executable).with_name("kvpilot")
    assert kvpilot.exists(), kvpilot
    for path in SYSTEMD.glob("*.*"):
        if path.suffix in {".service", ".timer"}:
            (tmp_path / path.name).write_text(path.read_text().replace(VENV_KVPILOT, str(kvpilot)))
    names = [p.name for p in tmp_path.iterdir() if "@." not in p.name]
    names += [f"{prefix}{instance}.service" for prefix, instance in INSTANCES.items()]
    run = subprocess.run([analyze, "verify", *sorted(names)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    complaints = [line for line in (run.stdout + run.stderr).splitlines() if str(tmp_path) in line or "kvpilot" in line]
    assert run.returncode == 0 and not complaints, run.stdout + run.stderr


def test_haproxy_accepts_the_balancer_config() -> None:
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed; the balancer config's syntax is not checked")
    run = subprocess.run([haproxy, "-c", "-f", str(HAPROXY)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
