"""The webhook body's bytes without an Alertmanager: Go's text forms on tricky input, AlertSlice order, and
max_alerts cutting before the status and common labels are computed. Expected strings are written out by
hand from Go's rules (tests/alerts/test_real_alertmanager_wire.py checks the same against the binary).
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from alerts.alertmanager import fingerprint, group_key, labelset_string, webhook_alert, webhook_body, webhook_payload
from alerts.config import Matcher, NotifierConfig, Receiver, Route, resolve_routes
from alerts.dispatch import Dispatcher, NotifyAlert
from alerts.gowire import go_json, go_quote, json_string, quote_meta, rfc3339
from alerts.state import FIRING, INACTIVE, ActiveAlert
from alerts.store import Lease
from collector.db import make_engine, session_factory
from collector.schema import AlertNotification
from tests.alerts.conftest import T0  # 2027-01-15T08:00:00Z


def test_json_strings_escape_as_go_encoding_json() -> None:
    text = '<a href="x">&\u2028\u2029\n\r\t\b\f\x00\x1f\x7f é 😀 \\'
    assert json_string(text) == (
        '"\\u003ca href=\\"x\\"\\u003e\\u0026\\u2028\\u2029\\n\\r\\t\\u0008\\u000c\\u0000\\u001f\x7f é 😀 \\\\"'
    )
    assert json_string("a\ud800b") == '"a\\ufffdb"'  # a lone surrogate: Go's replacement for invalid UTF-8


def test_go_json_keeps_order_writes_no_spaces_and_refuses_floats() -> None:
    assert go_json({"z": [1, True, None], "a": {"k": "v"}, "m": []}) == '{"z":[1,true,null],"a":{"k":"v"},"m":[]}'
    with pytest.raises(TypeError):
        go_json({"v": 1.5})


def test_go_quote_is_strconv_quote() -> None:
    value = 'a"b\\c\n\t\a\b\f\v\r\x00\x7f\u00a0é\u2028\ue000😀\U000e0001'
    assert go_quote(value) == '"a\\"b\\\\c\\n\\t\\a\\b\\f\\v\\r\\x00\\x7f\\u00a0é\\u2028\\ue000😀\\U000e0001"'


def test_quote_meta_is_regexp_quote_meta() -> None:
    assert quote_meta("a.b+c*d?e(f)g|h[i]j{k}l^m$n\\o-p_q r") == (
        "a\\.b\\+c\\*d\\?e\\(f\\)g\\|h\\[i\\]j\\{k\\}l\\^m\\$n\\\\o-p_q r"
    )


@pytest.mark.parametrize(
    ("ts", "text"),
    [
        (T0, "2027-01-15T08:00:00Z"),
        (T0 + 0.5, "2027-01-15T08:00:00.5Z"),
        (T0 + 0.1, "2027-01-15T08:00:00.1Z"),
        (T0 + 0.123456, "2027-01-15T08:00:00.123456Z"),
        (T0 + 59.00025, "2027-01-15T08:00:59.00025Z"),
        (None, "0001-01-01T00:00:00Z"),
    ],
)
def test_times_are_go_time_json(ts: float | None, text: str) -> None:
    assert rfc3339(ts) == text


def test_group_key_prints_labels_as_alertmanager_025() -> None:
    labels = {"alertname": "<&>", "a": "y", "a1": "x\n", "b": "é\u00a0"}
    assert labelset_string(labels) == '{a1="x\\n", a="y", alertname="<&>", b="é\\u00a0"}'  # '1' < '='
    assert group_key("{}/{}", labels) == '{}/{}:{a1="x\\n", a="y", alertname="<&>", b="é\\u00a0"}'


def test_route_key_sorts_matchers_and_escapes_them_as_alertmanager() -> None:
    matchers = [
        Matcher(name="team", value='ml"x\n\\'),
        Matcher(name="env", value="p", is_regex=True),
        Matcher(name="env", value="p"),
        Matcher(name="a", value="b", is_equal=False),
        Matcher(name="a", value="b", is_regex=True, is_equal=False),
    ]
    config = NotifierConfig(
        receivers=[Receiver(name="r", url="http://127.0.0.1:1/")],
        route=Route(receiver="r", routes=[Route(matchers=matchers)]),
    )
    _root, [child] = resolve_routes(config)
    assert child.key == '{}/{a!="b",a!~"b",env="p",env=~"p",team="ml\\"x\\n\\\\"}'


def _alert(labels: dict[str, str], annotations: dict[str, str] | None = None, resolved: bool = False) -> dict:
    return webhook_alert(
        status="resolved" if resolved else "firing",
        labels=labels,
        annotations=annotations or {},
        starts_at=T0,
        ends_at=T0 + 60 if resolved else None,
        generator="http://prom/graph",
    )


def _payload(alerts: list[dict], max_alerts: int = 0, receiver: str = "team") -> dict:
    return webhook_payload(
        receiver=receiver,
        alerts=alerts,
        group_labels={},
        group_key_text="{}:{}",
        external_url="http://am:9093",
        max_alerts=max_alerts,
    )


def test_alerts_are_ordered_as_alertmanagers_alert_slice() -> None:
    given = {
        "job b": {"job": "b"},
        "job a": {"job": "a", "instance": "z"},
        "instance a": {"instance": "a"},
        "x y": {"x": "1", "y": "1"},
        "w y": {"w": "2", "y": "1"},  # ('w','2') < ('x','1'), yet LabelSet.Before puts x y first: it lacks w
        "z": {"z": "0"},  # fewer labels come first
    }
    payload = _payload([_alert(labels) for labels in given.values()])
    by_labels = {json.dumps(v, sort_keys=True): k for k, v in given.items()}
    order = [by_labels[json.dumps(a["labels"], sort_keys=True)] for a in payload["alerts"]]
    assert order == ["job a", "job b", "instance a", "z", "x y", "w y"]


MIXED = [  # given out of order; sorted by instance: a (resolved), b, c
    _alert({"instance": "c", "team": "y", "sev": "page"}, {"runbook": "other"}),
    _alert({"instance": "a", "team": "x", "sev": "page"}, {"summary": "one", "runbook": "rb"}, resolved=True),
    _alert({"instance": "b", "team": "x", "sev": "page"}, {"summary": "two", "runbook": "rb"}),
]


@pytest.mark.parametrize(
    ("max_alerts", "status", "instances", "common", "common_notes", "truncated"),
    [
        (1, "resolved", ["a"], {"instance": "a", "sev": "page", "team": "x"}, {"runbook": "rb", "summary": "one"}, 2),
        (2, "firing", ["a", "b"], {"sev": "page", "team": "x"}, {"runbook": "rb"}, 1),
        (0, "firing", ["a", "b", "c"], {"sev": "page"}, {}, 0),
        (5, "firing", ["a", "b", "c"], {"sev": "page"}, {}, 0),
    ],
)
def test_max_alerts_cuts_first_then_status_and_common_labels_follow_the_kept(
    max_alerts: int, status: str, instances: list[str], common: dict, common_notes: dict, truncated: int
) -> None:
    payload = _payload(MIXED, max_alerts)
    assert [a["labels"]["instance"] for a in payload["alerts"]] == instances
    assert payload["status"] == status
    assert payload["commonLabels"] == common and list(payload["commonLabels"]) == sorted(common)
    assert payload["commonAnnotations"] == common_notes
    assert payload["truncatedAlerts"] == truncated


def test_body_is_go_json_with_sorted_maps_and_a_trailing_newline() -> None:
    labels = {"z": "1", "alertname": "A<B"}  # unsorted on purpose
    alert = webhook_alert(
        status="resolved",
        labels=labels,
        annotations={"s": "x&y", "a": "é\u2029"},
        starts_at=T0 + 0.25,
        ends_at=T0 + 90,
        generator="http://g/?a=1&b=2",
    )
    payload = webhook_payload(
        receiver="team.a",
        alerts=[alert],
        group_labels={"alertname": "A<B"},
        group_key_text=group_key("{}", {"alertname": "A<B"}),
        external_url="http://am:9093",
    )
    body = webhook_body(payload)
    assert body == (
        '{"receiver":"team\\\\.a","status":"resolved","alerts":[{"status":"resolved",'
        '"labels":{"alertname":"A\\u003cB","z":"1"},"annotations":{"a":"é\\u2029","s":"x\\u0026y"},'
        '"startsAt":"2027-01-15T08:00:00.25Z","endsAt":"2027-01-15T08:01:30Z",'
        f'"generatorURL":"http://g/?a=1\\u0026b=2","fingerprint":"{fingerprint(labels)}"}}],'
        '"groupLabels":{"alertname":"A\\u003cB"},"commonLabels":{"alertname":"A\\u003cB","z":"1"},'
        '"commonAnnotations":{"a":"é\\u2029","s":"x\\u0026y"},"externalURL":"http://am:9093","version":"4",'
        '"groupKey":"{}:{alertname=\\"A\\u003cB\\"}","truncatedAlerts":0}\n'
    )
    assert json.loads(body) == payload


def test_dispatcher_outbox_body_with_one_kept_resolved_alert_says_resolved(sqlite_url: str) -> None:
    config = NotifierConfig(
        receivers=[Receiver(name="team", url="http://127.0.0.1:1/", max_alerts=1)],
        route=Route(receiver="team", group_by=["sev"], group_wait_s=0),
    )
    items = []
    for labels, resolved in (({"instance": "b", "sev": "page"}, False), ({"instance": "a", "sev": "page"}, True)):
        alert = ActiveAlert(
            rule="R",
            fingerprint=fingerprint(labels),
            labels=labels,
            annotations={},
            state=INACTIVE if resolved else FIRING,
            active_at=T0,
            value=1.0,
            fired_at=T0,
            resolved_at=T0 + 30 if resolved else None,
        )
        items.append(NotifyAlert(alert, "http://prom/graph"))
    engine = make_engine(sqlite_url)
    try:
        with session_factory(engine)() as session:
            Dispatcher(config).dispatch(session, items, now=T0 + 40, lease=Lease("t", 1, T0 + 100))
            [body] = session.execute(select(AlertNotification.body)).scalars()
    finally:
        engine.dispose()
    assert body.endswith("}\n") and ", " not in body
    payload = json.loads(body)
    assert (payload["status"], payload["truncatedAlerts"]) == ("resolved", 1)
    assert [a["labels"]["instance"] for a in payload["alerts"]] == ["a"]
    assert payload["commonLabels"] == {"instance": "a", "sev": "page"}
    assert payload["groupKey"] == '{}:{sev="page"}'
