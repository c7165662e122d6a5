"""schemathesis against the collector's own OpenAPI schema: no generated request gets a 5xx.

Positive (schema-valid) and negative (schema-violating) cases for every operation, with and
without the token, sent over real HTTP to a collector serving in a thread.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from collector import bundle
from collector.server import create_app, run_in_thread
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev

TOKEN = "fuzz-token"


@schemathesis.serializer(bundle.MEDIA_TYPE)
def _bundle_bytes(ctx: object, value: object) -> bytes:
    """A bundle's body is bytes in its own framing (`collector.bundle`): what was generated goes as it is."""
    return value if isinstance(value, bytes) else str(value).encode()


RAW_SCHEMA = create_app(CollectorSettings(scrape_enabled=False)).openapi()
SCHEMA = schemathesis.openapi.from_dict(RAW_SCHEMA)
OPERATIONS = {
    f"{method.upper()} {path}": op for path, item in RAW_SCHEMA["paths"].items() for method, op in item.items()
}
LABELS = sorted(OPERATIONS)
# Negative cases need something to violate: a parameter or a body (auth aside).
CASES = [(label, GenerationMode.POSITIVE) for label in LABELS] + [
    (label, GenerationMode.NEGATIVE)
    for label in LABELS
    if OPERATIONS[label].get("parameters") or OPERATIONS[label].get("requestBody")
]


@pytest.fixture(scope="module")
def collector_url(_sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    shutil.copyfile(_sqlite_template, path)
    handle = run_in_thread(
        CollectorSettings(
            db_url=f"sqlite:///{path}",
            ingest_token=TOKEN,
            port=0,
            scrape_enabled=False,
            log_level="warning",
            raw_retention_days=ev.REPLAY_RETENTION_DAYS,
        )
    )
    yield handle.url
    handle.stop()


def test_schema_lists_the_api() -> None:
    assert {
        "POST /v1/ingest",
        "POST /v1/traces",
        "POST /v1/targets",
        "GET /v1/targets",
        "DELETE /v1/targets/{target_id}",
    } <= set(LABELS)


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label} {mode.value}" for label, mode in CASES])
@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_no_server_errors(collector_url: str, label: str, mode: GenerationMode, token: str | None) -> None:
    operation = SCHEMA.find_operation_by_label(label)
    assert operation is not None, label
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    examples = 25 if token else 5
    statuses: list[int] = []

    @settings(
        max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
    )
    @given(operation.as_strategy(mode))
    def check(case) -> None:
        response = case.call(base_url=collector_url, headers=headers)
        statuses.append(response.status_code)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
        )

    check()
    assert statuses
