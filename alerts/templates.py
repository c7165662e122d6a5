"""Prometheus alert templates: the Go text/template subset rule labels and annotations use in practice.

Supported: `{{ $labels.name }}`, `{{ .Labels.name }}`, `{{ $value }}`, `{{ .Value }}`, `{{ $externalLabels.x }}`,
`{{ $externalURL }}`, pipes into `humanize`, `humanizePercentage`, `humanizeDuration`, `printf "%.2f"`, `title`,
`toUpper`, `toLower`, and `{{-`/`-}}` trimming. Anything else (if/range/with) is rejected when the rule file
loads, never at 3 a.m. when the alert fires. Values print as Go prints a float64 (`%v`), so an annotation
reads exactly as Prometheus would render it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)


class TemplateError(ValueError):
    """A template this renderer cannot expand the way Prometheus would."""


@dataclass(frozen=True)
class _Pipeline:
    source: str  # "$labels.x", "$value", "$externalLabels.x", "$externalURL", or a literal
    literal: str | None
    funcs: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Template:
    text: str
    parts: tuple[str | _Pipeline, ...]

    def render(
        self,
        labels: dict[str, str],
        value: float,
        external_labels: dict[str, str] | None = None,
        external_url: str = "",
    ) -> str:
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            current: object = _resolve(part, labels, value, external_labels or {}, external_url)
            for name, args in part.funcs:
                current = _FUNCS[name](current, *args)
            out.append(current if isinstance(current, str) else go_format(current))
        return "".join(out)


def compile_template(text: str) -> Template:
    parts: list[str | _Pipeline] = []
    pos = 0
    for match in _ACTION.finditer(text):
        literal = text[pos : match.start()]
        if match.group(1):
            literal = literal.rstrip()
        if parts and isinstance(parts[-1], str) and parts[-1] == "\0trim":
            parts.pop()
            literal = literal.lstrip()
        if literal:
            parts.append(literal)
        parts.append(_parse_action(match.group(2).strip(), text))
        if match.group(3):
            parts.append("\0trim")
        pos = match.end()
    tail = text[pos:]
    if parts and parts[-1] == "\0trim":
        parts.pop()
        tail = tail.lstrip()
    if "{{" in tail or "}}" in tail:
        raise TemplateError(f"unbalanced braces in template {text!r}")
    if tail:
        parts.append(tail)
    return Template(text, tuple(parts))


_VAR = re.compile(r"^(\$labels|\.Labels|\$externalLabels|\.ExternalLabels)\.([a-zA-Z_][a-zA-Z0-9_]*)$")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`|[^\s|]+|\|')


def _parse_action(body: str, whole: str) -> _Pipeline:
    if not body or body.startswith("/*"):
        raise TemplateError(f"empty or comment action in template {whole!r}")
    stages = [s.strip() for s in _split_pipes(body)]
    first = _TOKEN.findall(stages[0])
    funcs: list[tuple[str, tuple[str, ...]]] = []
    head = first[0]
    if head in _FUNCS:  # prefix call, e.g. printf "%.2f" $value  or  humanize $value
        if len(first) < 2:
            raise TemplateError(f"{head} needs an argument in template {whole!r}")
        source_text = first[-1]
        funcs.append((head, tuple(_unquote(a) for a in first[1:-1])))
    elif len(first) == 1:
        source_text = head
    else:
        raise TemplateError(
            f"unsupported template action {{{{ {body} }}}} in {whole!r} (supported: $labels.x, "
            f"$value, pipes into {', '.join(sorted(_FUNCS))})"
        )
    for stage in stages[1:]:
        words = _TOKEN.findall(stage)
        if not words or words[0] not in _FUNCS:
            raise TemplateError(f"unknown template function {stage!r} in {whole!r}")
        funcs.append((words[0], tuple(_unquote(a) for a in words[1:])))
    if source_text in ("$value", ".Value", "$externalURL", ".ExternalURL"):
        return _Pipeline(source_text, None, tuple(funcs))
    if _VAR.match(source_text):
        return _Pipeline(source_text, None, tuple(funcs))
    if source_text.startswith(('"', "`")):
        return _Pipeline("literal", _unquote(source_text), tuple(funcs))
    raise TemplateError(
        f"unsupported template action {{{{ {body} }}}} in {whole!r} (if/range/with and other "
        "variables are not supported)"
    )


def _split_pipes(body: str) -> list[str]:
    stages, current, quote = [], [], ""
    for ch in body:
        if quote:
            current.append(ch)
            if ch == quote:
                quote = ""
        elif ch in '"`':
            quote = ch
            current.append(ch)
        elif ch == "|":
            stages.append("".join(current))
            current = []
        else:
            current.append(ch)
    stages.append("".join(current))
    return stages


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in '"`':
        inner = text[1:-1]
        return inner.encode().decode("unicode_escape") if text[0] == '"' else inner
    return text


def _resolve(
    part: _Pipeline, labels: dict[str, str], value: float, external: dict[str, str], external_url: str
) -> object:
    if part.literal is not None:
        return part.literal
    if part.source in ("$value", ".Value"):
        return value
    if part.source in ("$externalURL", ".ExternalURL"):
        return external_url
    match = _VAR.match(part.source)
    assert match is not None
    table = labels if match.group(1) in ("$labels", ".Labels") else external
    return table.get(match.group(2), "<no value>" if match.group(1).startswith(".") else "")


def go_format(value: object) -> str:
    """Go's `%v` for a float64 (strconv 'g', shortest): exponent form below 1e-4 or from 1e6 up, as Go prints."""
    if isinstance(value, str):
        return value
    if not isinstance(value, int | float):
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == 0:
        return "-0" if math.copysign(1, v) < 0 else "0"
    digits, exp = _shortest(v)
    sign = "-" if v < 0 else ""
    if exp < -4 or exp >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if exp < 0:
        return f"{sign}0.{'0' * (-exp - 1)}{digits}"
    if exp + 1 >= len(digits):
        return sign + digits + "0" * (exp + 1 - len(digits))
    return f"{sign}{digits[: exp + 1]}.{digits[exp + 1 :]}"


def _shortest(v: float) -> tuple[str, int]:
    text = repr(abs(v))
    if "e" in text:
        mant, _, ex = text.partition("e")
        digits = mant.replace(".", "").rstrip("0") or "0"
        return digits, int(ex)
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0")
    if whole != "0":
        return (whole + frac).rstrip("0") or "0", len(whole) - 1
    stripped = frac.lstrip("0")
    return stripped, -(len(frac) - len(stripped)) - 1


def _to_float(value: object) -> float:
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(str(value))
    except ValueError as exc:
        raise TemplateError(f"cannot convert {value!r} to a number") from exc


def humanize(value: object) -> str:
    v = _to_float(value)
    if v == 0 or math.isnan(v) or math.isinf(v):
        return _go_g4(v)
    prefix = ""
    if abs(v) >= 1:
        for p in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(v) < 1000:
                break
            prefix, v = p, v / 1000
        return _go_g4(v) + prefix
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(v) >= 1:
            break
        prefix, v = p, v * 1000
    return _go_g4(v) + prefix


def humanize_percentage(value: object) -> str:
    return _go_g4(_to_float(value) * 100) + "%"


def humanize_duration(value: object) -> str:
    v = _to_float(value)
    if v == 0 or math.isnan(v) or math.isinf(v):
        return _go_g4(v)
    if abs(v) < 1:
        prefix = ""
        for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
            if abs(v) >= 1:
                break
            prefix, v = p, v * 1000
        return f"{_go_g4(v)}{prefix}s"
    sign = "-" if v < 0 else ""
    v = abs(v)
    seconds = int(v) % 60
    minutes = int(v) // 60 % 60
    hours = int(v) // 3600 % 24
    days = int(v) // 86400
    if days:
        return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
    if hours:
        return f"{sign}{hours}h {minutes}m {seconds}s"
    if minutes:
        return f"{sign}{minutes}m {seconds}s"
    return f"{sign}{v:.4g}s"


def _go_g4(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return f"{v:.4g}"


def _printf(value: object, fmt: str = "%v") -> str:
    if fmt == "%v":
        return go_format(value)
    try:
        return fmt % (value,)
    except (TypeError, ValueError) as exc:
        raise TemplateError(f"printf {fmt!r} cannot format {value!r}") from exc


_FUNCS: dict[str, Callable[..., str]] = {
    "humanize": lambda v: humanize(v),
    "humanizePercentage": lambda v: humanize_percentage(v),
    "humanizeDuration": lambda v: humanize_duration(v),
    "printf": lambda v, fmt="%v": _printf(v, fmt),
    "title": lambda v: str(v).title(),
    "toUpper": lambda v: str(v).upper(),
    "toLower": lambda v: str(v).lower(),
}
