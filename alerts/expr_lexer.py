"""Tokens of kvpilot's alert expression language (a PromQL subset), each with its 1-based line and column."""

from __future__ import annotations

import re
from dataclasses import dataclass

KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "bool", "offset", "group_left", "group_right"}
)


class ExprSyntaxError(ValueError):
    """A parse error at `line`:`column` of the expression text (1-based)."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"{message} (line {line}, column {column})")
        self.message = message
        self.line = line
        self.column = column


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # NUMBER DURATION IDENT KEYWORD STRING OP EOF
    text: str
    line: int
    column: int


_DURATION = re.compile(r"(?:\d+(?:ms|[smhdwy]))+")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_OPS = (
    "==",
    "!=",
    "<=",
    ">=",
    "=~",
    "!~",
    "+",
    "-",
    "*",
    "/",
    "%",
    "^",
    "<",
    ">",
    "=",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
)


def tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        ch = text[pos]
        col = pos - line_start + 1
        if ch == "\n":
            pos += 1
            line, line_start = line + 1, pos
            continue
        if ch in " \t\r":
            pos += 1
            continue
        if ch == "#":
            while pos < len(text) and text[pos] != "\n":
                pos += 1
            continue
        if ch in "\"'`":
            end, value = _scan_string(text, pos, line, col)
            tokens.append(Token("STRING", value, line, col))
            pos = end
            continue
        if ch.isdigit() or (ch == "." and pos + 1 < len(text) and text[pos + 1].isdigit()):
            start = pos
            dur = _DURATION.match(text, pos)
            num = _NUMBER.match(text, pos)
            if dur and (num is None or dur.end() > num.end()):
                tokens.append(Token("DURATION", dur.group(), line, col))
                pos = dur.end()
            else:
                assert num is not None  # a digit or ".digit" always matches _NUMBER
                tokens.append(Token("NUMBER", num.group(), line, col))
                pos = num.end()
            if pos < len(text) and (text[pos].isalpha() or text[pos] == "_"):
                raise ExprSyntaxError(f"bad number or duration {text[start : pos + 1]!r}", line, col)
            continue
        ident = _IDENT.match(text, pos)
        if ident:
            word = ident.group()
            kind = "KEYWORD" if word.lower() in KEYWORDS else "IDENT"
            tokens.append(Token(kind, word.lower() if kind == "KEYWORD" else word, line, col))
            pos = ident.end()
            continue
        for op in _OPS:
            if text.startswith(op, pos):
                tokens.append(Token("OP", op, line, col))
                pos += len(op)
                break
        else:
            raise ExprSyntaxError(f"unexpected character {ch!r}", line, col)
    body = text.rstrip()
    eof_line = body.count("\n") + 1
    tokens.append(Token("EOF", "", eof_line, len(body) - (body.rfind("\n") + 1) + 1))
    return tokens


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "`": "`"}


def _scan_string(text: str, start: int, line: int, col: int) -> tuple[int, str]:
    quote = text[start]
    pos = start + 1
    out: list[str] = []
    while pos < len(text):
        ch = text[pos]
        if ch == quote:
            return pos + 1, "".join(out)
        if ch == "\n" and quote != "`":
            break
        if ch == "\\" and quote != "`":
            nxt = text[pos + 1 : pos + 2]
            if nxt not in _ESCAPES:
                raise ExprSyntaxError(f"unknown escape sequence \\{nxt}", line, col + pos - start)
            out.append(_ESCAPES[nxt])
            pos += 2
            continue
        out.append(ch)
        pos += 1
    raise ExprSyntaxError("unterminated string", line, col)
