"""What `kvpilot vllm serve` adds to vLLM's command line and environment, and its refusals (no vLLM needed)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from integrations.vllm.wiring import (
    VLLM_PYTHON_ENV,
    Endpoint,
    VllmSetupError,
    build_command,
    build_env,
    find_vllm_python,
    option_value,
    stopped_cleanly,
)
from kvpilot.cli import app

runner = CliRunner()


def test_command_adds_iteration_lines_and_the_span_endpoint_unless_given() -> None:
    cmd = build_command("/py", ["--model", "m", "--port=9000"], traces_endpoint="http://c:8100/v1/traces")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[3:] == [
        "--model",
        "m",
        "--port=9000",
        "--enable-logging-iteration-details",
        "--otlp-traces-endpoint",
        "http://c:8100/v1/traces",
        "--middleware",
        "kvpilot_arrival.ArrivalStamp",
    ]
    theirs = build_command("/py", ["--otlp-traces-endpoint=http://x/v1/traces"], traces_endpoint="http://c/v1/traces")
    assert theirs.count("--otlp-traces-endpoint") == 0 and "--otlp-traces-endpoint=http://x/v1/traces" in theirs
    assert "--middleware" in theirs  # the arrival stamp rides on whichever endpoint the spans go to
    assert not {"--otlp-traces-endpoint", "--middleware"} & set(build_command("/py", [], traces_endpoint=None))
    with pytest.raises(VllmSetupError, match="--disable-log-stats"):
        build_command("/py", ["--disable-log-stats"], traces_endpoint=None)


def test_env_names_the_instance_and_run_and_carries_the_token_as_an_otlp_header() -> None:
    env = build_env(
        {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"},
        instance="gpu-1:8000",
        run_id="run 7",
        token="s3cr=t",
        traces=True,
    )
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf" and env["OTEL_SERVICE_NAME"] == "vllm"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == (
        "deployment.environment=prod,service.instance.id=gpu-1%3A8000,kvpilot.run_id=run%207"
    )
    assert env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "Authorization=Bearer%20s3cr%3Dt"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("integrations", "vllm", "asgi"))
    assert build_env({"PYTHONPATH": "/mine"}, instance="i", run_id="r", token=None, traces=True)["PYTHONPATH"].endswith(
        os.pathsep + "/mine"
    )
    plain = build_env({"KVPILOT_ADMIN_TOKEN": "a", "PATH": "/bin"}, instance="i", run_id="r", token="t", traces=False)
    assert not any(k.startswith("OTEL_") for k in plain)
    # every line carries the time vLLM logged it; an operator's own prefix follows ours, never doubled
    assert plain["VLLM_LOGGING_PREFIX"] == "%(created).6f "
    theirs = build_env({"VLLM_LOGGING_PREFIX": "[node-3] "}, instance="i", run_id="r", token=None, traces=False)
    assert theirs["VLLM_LOGGING_PREFIX"] == "%(created).6f [node-3] "
    again = build_env(theirs, instance="i", run_id="r", token=None, traces=False)
    assert again["VLLM_LOGGING_PREFIX"] == "%(created).6f [node-3] "
    assert plain["PATH"] == "/bin" and "KVPILOT_ADMIN_TOKEN" not in plain  # no kvpilot credential reaches vLLM
    for bad in ({"VLLM_LOGGING_LEVEL": "warning"}, {"VLLM_CONFIGURE_LOGGING": "0"}):
        with pytest.raises(VllmSetupError):
            build_env(bad, instance="i", run_id="r", token=None, traces=True)


def test_endpoint_from_vllm_args() -> None:
    assert Endpoint.from_args([]).url == "http://127.0.0.1:8000"
    assert Endpoint.from_args(["--host", "0.0.0.0", "--port", "8123"]).url == "http://127.0.0.1:8123"
    assert Endpoint.from_args(["--host=::", "--port=1"]).url == "http://[::1]:1"
    assert option_value(["--port", "1", "--port=2"], "--port") == "2"
    for bad in (["--port", "http"], ["--port", "70000"]):
        with pytest.raises(VllmSetupError, match="--port"):
            Endpoint.from_args(bad)


def test_finding_the_vllm_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(VllmSetupError, match="make vllm-venv"):
        find_vllm_python(root=tmp_path)
    local = tmp_path / ".venv-vllm" / "bin" / "python"
    local.parent.mkdir(parents=True)
    local.symlink_to(sys.executable)
    assert find_vllm_python(root=tmp_path) == str(local)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(VllmSetupError, match=VLLM_PYTHON_ENV):
        find_vllm_python(root=tmp_path)
    assert find_vllm_python(sys.executable, root=tmp_path) == sys.executable


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--vllm-python", "/nonexistent/python", "--", "--model", "m"], "is not an executable"),
        (["--collector", "ftp://x", "--", "--model", "m"], "is not an http(s) URL"),
        (["--label", "novalue", "--", "--model", "m"], "NAME=VALUE"),
        (["--vllm-python", sys.executable, "--", "--disable-log-stats"], "--disable-log-stats"),
        (["--vllm-python", sys.executable, "--instance", "x" * 300, "--", "--model", "m"], "instance must be"),
    ],
)
def test_serve_refuses_clearly(args: list[str], needle: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["vllm", "serve", "--spool-dir", str(tmp_path), *args])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert "Traceback" not in result.output
    assert not any(os.scandir(tmp_path))  # refused before anything started or spooled


def test_a_stop_is_clean_only_when_vllm_ends_by_what_it_was_asked() -> None:
    term, intr = {signal.SIGTERM}, {signal.SIGINT}
    assert stopped_cleanly(0, term) and stopped_cleanly(-signal.SIGTERM, term)
    assert stopped_cleanly(128 + signal.SIGINT, intr)  # the shells' 130 after a forwarded Ctrl-C
    assert not stopped_cleanly(1, term)  # it failed on its way down: a crash
    assert not stopped_cleanly(-signal.SIGKILL, term)  # killed by someone else (the OOM killer)
    assert not stopped_cleanly(0, set())  # exited on its own, unasked
    assert not stopped_cleanly(-signal.SIGTERM, set()) and not stopped_cleanly(None, term)


def test_the_arrival_stamp_keeps_a_valid_trace_and_replaces_anything_else() -> None:
    from integrations.vllm.asgi.kvpilot_arrival import stamped_headers

    def stamp(*headers: tuple[bytes, bytes]) -> dict[bytes, bytes]:
        out = stamped_headers(list(headers), 1_790_000_000.25)
        assert [k for k, _ in out].count(b"traceparent") == 1 and [k for k, _ in out].count(b"tracestate") == 1
        return dict(out)

    fresh = stamp((b"content-type", b"application/json"))
    assert fresh[b"content-type"] == b"application/json"
    assert fresh[b"tracestate"] == b"kvpilot=t1790000000250000" and fresh[b"traceparent"].endswith(b"-01")
    theirs = b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-00"  # not sampled: the client's choice, kept
    kept = stamp((b"TraceParent", theirs), (b"tracestate", b"a=1, kvpilot=t5,bad member,b=2"))
    assert kept[b"traceparent"] == theirs and kept[b"tracestate"] == b"kvpilot=t1790000000250000,a=1,b=2"
    for invalid in (b"00-" + b"0" * 32 + b"-" + b"2" * 16 + b"-01", b"ff-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"):
        replaced = stamp((b"traceparent", invalid), (b"tracestate", b"a=1"))
        assert replaced[b"traceparent"] != invalid and replaced[b"tracestate"] == b"kvpilot=t1790000000250000"
    many = b",".join(b"k%d=v" % i for i in range(40))
    assert stamp((b"traceparent", theirs), (b"tracestate", many))[b"tracestate"].count(b",") == 31


def test_the_first_streamed_bytes_go_on_the_request_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """The middleware notes a streamed response's first bytes; its span processor writes them on llm_request."""
    import asyncio

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from integrations.vllm.asgi import kvpilot_arrival as mw

    provider, memory = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    monkeypatch.setattr(mw, "_processor_added", False)
    seen: dict[str, dict[str, str]] = {}

    def app_for(name: str, content_type: bytes):
        async def app(scope, receive, send) -> None:
            seen[name] = {k.decode(): v.decode() for k, v in scope["headers"]}
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
            await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

        return app

    async def noop(_message: dict) -> None:
        return None

    for name, kind in (("stream", b"text/event-stream"), ("whole", b"application/json")):
        asyncio.run(mw.ArrivalStamp(app_for(name, kind))({"type": "http", "headers": []}, None, noop))
    tracer = provider.get_tracer("vllm")
    for name in ("stream", "whole"):  # as vLLM does when the request finishes: a child of its trace headers
        context = TraceContextTextMapPropagator().extract(seen[name])
        tracer.start_span("llm_request", context=context).end()
    spans = {format(s.context.trace_id, "032x"): s for s in memory.get_finished_spans()}
    stream, whole = (spans[seen[n]["traceparent"][3:35]] for n in ("stream", "whole"))
    assert abs(stream.attributes[mw.FIRST_BYTE_ATTRIBUTE] - time.time()) < 60
    assert mw.FIRST_BYTE_ATTRIBUTE not in whole.attributes  # not streamed: its first bytes are its last
    assert stream.context.trace_state.get("kvpilot", "").startswith("t") and not mw._first_bytes


def test_the_bench_timing_file_reaches_vllm_through_the_launchers_environment() -> None:
    """`benchmarks.user_latency --decompose` names its timing file to the middleware inside vLLM; a KVPILOT_ name
    would be kept from vLLM like kvpilot's credentials (that run died on a KeyError)."""
    from benchmarks.asgi.kvpilot_bench_timing import BENCH_TIMING_ENV

    env = build_env({BENCH_TIMING_ENV: "/tmp/t.jsonl"}, instance="i", run_id="r", token=None, traces=True)
    assert env[BENCH_TIMING_ENV] == "/tmp/t.jsonl"
