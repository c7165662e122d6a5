"""One matcher for routes and silences: both spellings in, the API's spelling out, the same match rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from alerts.config import NotifierConfig
from alerts.matchers import Matcher


def test_route_and_silence_spellings_are_one_matcher() -> None:
    from_yaml = Matcher.model_validate({"name": "env", "value": "p.*", "is_regex": True, "is_equal": False})
    from_api = Matcher.model_validate({"name": "env", "value": "p.*", "isRegex": True, "isEqual": False})
    assert from_yaml == from_api
    assert from_api.model_dump() == {"name": "env", "value": "p.*", "isRegex": True, "isEqual": False}
    assert from_api.text() == 'env!~"p.*"'


@pytest.mark.parametrize(
    ("matcher", "labels", "hit"),
    [
        ({"name": "a", "value": "b"}, {"a": "b"}, True),
        ({"name": "a", "value": "b", "isEqual": False}, {"a": "b"}, False),
        ({"name": "a", "value": ""}, {}, True),  # a missing label is the empty string
        ({"name": "a", "value": "b|c", "isRegex": True}, {"a": "c"}, True),
        ({"name": "a", "value": "b|c", "isRegex": True}, {"a": "bc"}, False),  # fully anchored
    ],
)
def test_match_rule(matcher: dict, labels: dict[str, str], hit: bool) -> None:
    assert Matcher.model_validate(matcher).matches(labels) is hit


def test_route_matchers_are_bounded_like_silence_matchers() -> None:
    with pytest.raises(ValidationError, match="name"):
        NotifierConfig.model_validate(
            {
                "receivers": [{"name": "r", "url": "http://x"}],
                "route": {
                    "receiver": "r",
                    "routes": [{"receiver": "r", "matchers": [{"name": "bad name", "value": "x"}]}],
                },
            }
        )
    with pytest.raises(ValidationError, match="control characters"):
        Matcher(name="a", value="x\x00")
    with pytest.raises(ValidationError, match="bad regular expression"):
        Matcher(name="a", value="(", is_regex=True)
