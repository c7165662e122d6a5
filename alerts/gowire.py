"""Go's text forms, byte for byte, for the Alertmanager wire formats kvpilot reproduces.

Alertmanager writes its webhook body with encoding/json (json.NewEncoder: HTML-safe escapes, no spaces, a
trailing newline), label values in group keys with strconv.Quote (`%q`), the receiver with regexp.QuoteMeta
and times with time.Time's MarshalJSON. Python's json, repr and isoformat each differ from these in small
ways (`<` kept raw, `", "` separators, `\\b` escapes, `+00:00`), and a receiver that compares or signs the
bytes sees every one of them.

Go version: Go before 1.22 writes backspace and form feed as `\\u0008`/`\\u000c`, 1.22 and later as
`\\b`/`\\f`. We write the former, as Alertmanager 0.25 (Debian's package, built with go1.19) does.
Printable is Python's str.isprintable(), which is Go's unicode.IsPrint (categories L, M, N, P, S and
the ASCII space); the two may disagree on code points assigned between their Unicode versions.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence

GO_ZERO_TIME = "0001-01-01T00:00:00Z"

_JSON_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    # HTML-safe, as encoding/json's default: a body pasted into a page cannot open a tag.
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    # Line and paragraph separators end a JavaScript string literal; Go escapes them for JSONP.
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_JSON_SPECIAL = re.compile('["\\\\<>&\u2028\u2029\x00-\x1f\ud800-\udfff]')

_QUOTE_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    '"': '\\"',
    "\\": "\\\\",
}
_REGEXP_META = frozenset("\\.+*?()|[]{}^$")


def _json_escape(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _JSON_ESCAPES:
        return _JSON_ESCAPES[ch]
    if "\ud800" <= ch <= "\udfff":
        return "\\ufffd"  # Go replaces invalid UTF-8 (what a lone surrogate would be) with U+FFFD
    return f"\\u{ord(ch):04x}"


def json_string(text: str) -> str:
    """encoding/json's string: the escapes above, other controls as \\u00XX, everything else raw UTF-8."""
    return '"' + _JSON_SPECIAL.sub(_json_escape, text) + '"'


def go_json(value: object) -> str:
    """json.Marshal of the value: dicts in their own order (build Go maps sorted, structs in field order).

    Floats are refused: Go formats them differently from Python and no field we send holds one.
    """
    if isinstance(value, str):
        return json_string(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{json_string(str(k))}:{go_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    raise TypeError(f"go_json cannot encode {type(value).__name__} {value!r}")


def go_map(mapping: Mapping[str, str]) -> dict[str, str]:
    """A Go map as encoding/json writes it: keys in byte order (UTF-8 order is code point order)."""
    return dict(sorted(mapping.items()))


def go_quote(value: str) -> str:
    """strconv.Quote (what `%q` prints): printable runes raw, the rest escaped with lowercase hex."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch in _QUOTE_ESCAPES:
            out.append(_QUOTE_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF:  # a lone surrogate: the invalid bytes Go would see, one \x each
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def quote_meta(text: str) -> str:
    """regexp.QuoteMeta: a backslash before each of \\.+*?()|[]{}^$ (Alertmanager's template `receiver`)."""
    return "".join("\\" + ch if ch in _REGEXP_META else ch for ch in text)


def rfc3339(ts: float | None) -> str:
    """Go's time.Time MarshalJSON (RFC3339Nano, UTC, trailing zeros of the fraction trimmed).

    kvpilot keeps times as float seconds, so the fraction has microseconds at most; None is Go's zero time.
    """
    if ts is None:
        return GO_ZERO_TIME
    micros = round(ts * 1_000_000)
    when = dt.datetime.fromtimestamp(micros // 1_000_000, tz=dt.UTC)
    base = when.strftime("%Y-%m-%dT%H:%M:%S")
    frac = micros % 1_000_000
    if frac:
        base += "." + f"{frac:06d}".rstrip("0")
    return base + "Z"
