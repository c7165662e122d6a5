"""Clipping to a context limit caps both lengths and never lengthens either."""

from __future__ import annotations

import itertools

import pytest

from plumbing.lengths import clip_lengths


def test_a_short_prompt_is_not_lengthened() -> None:
    # The load tester's old copy gave 75/25 here: the prompt grew from 50 to fill the limit.
    assert clip_lengths(50, 80, 100) == (50, 25)


@pytest.mark.parametrize(
    ("prompt", "output", "limit", "expected"),
    [
        (40, 50, 100, (40, 50)),  # fits: unchanged
        (400, 500, None, (400, 500)),  # no limit
        (900, 300, 100, (75, 25)),  # both capped: output at a quarter, the prompt at the rest
        (900, 10, 100, (90, 10)),  # a short output is kept; the prompt takes what is left
        (1, 200, 100, (1, 25)),  # a 1-token prompt stays 1 token
        (50, 50, 3, (2, 1)),  # tiny limits keep a 2-token prompt and a 1-token output
    ],
)
def test_clip_rule(prompt: int, output: int, limit: int | None, expected: tuple[int, int]) -> None:
    assert clip_lengths(prompt, output, limit) == expected


def test_never_lengthens_and_fits_every_limit_of_four_or_more() -> None:
    for prompt, output, limit in itertools.product((1, 2, 3, 30, 75, 200), (1, 2, 24, 25, 80), (4, 10, 100, 101)):
        p, o = clip_lengths(prompt, output, limit)
        assert p <= prompt and o <= output
        assert p + o <= limit, (prompt, output, limit)
