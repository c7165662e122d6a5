"""Recursive-descent parser for the alert expression language; errors carry line and column.

Grammar (a PromQL subset, precedence lowest first: `or`; `and` `unless`; comparisons; `+ -`; `* / %`; `^`):

    expr      := expr binop [bool] [(on|ignoring)(l,...) [(group_left|group_right) [(l,...)]]] expr | unary
    unary     := ('-' | '+') unary | primary
    primary   := NUMBER | Inf | NaN | '(' expr ')' | call | aggregate | selector
    selector  := NAME ['{' label op "value", ... '}'] ['[' DURATION ']'] [offset DURATION]
                 (any label; NAME may contain ':' as vllm:num_requests_waiting does)
    call      := FUNC '(' [expr, ...] ')'
    aggregate := AGG [by|without (l,...)] '(' [scalar ','] expr ')' [by|without (l,...)]
"""

from __future__ import annotations

import re

from alerts.durations import DurationError, parse_duration
from alerts.expr_ast import (
    AGGREGATIONS,
    COMPARISONS,
    FUNCTIONS,
    SET_OPS,
    Aggregate,
    Binary,
    Call,
    Matcher,
    MatrixSelector,
    Node,
    NumberLiteral,
    Paren,
    Unary,
    VectorSelector,
    value_type,
)
from alerts.expr_lexer import ExprSyntaxError, Token, tokenize
from alerts.regex import RegexError
from alerts.regex import check as check_regex

_PRECEDENCE = {
    "or": 1,
    "and": 2,
    "unless": 2,
    "==": 3,
    "!=": 3,
    ">": 3,
    "<": 3,
    ">=": 3,
    "<=": 3,
    "+": 4,
    "-": 4,
    "*": 5,
    "/": 5,
    "%": 5,
    "^": 6,
}
_UNARY_PRECEDENCE = 5  # as PromQL: -a*b is (-a)*b, -a^b is -(a^b)
_MATCH_OPS = ("=", "!=", "=~", "!~")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def parse_expr(text: str) -> Node:
    """Parse and type-check `text`; raises ExprSyntaxError with a 1-based line and column."""
    parser = _Parser(tokenize(text))
    if parser.peek().kind == "EOF":
        raise ExprSyntaxError("empty expression", 1, 1)
    node = parser.expression(0)
    tok = parser.peek()
    if tok.kind != "EOF":
        raise ExprSyntaxError(f"unexpected {_describe(tok)} after the end of the expression", tok.line, tok.column)
    if value_type(node) == "matrix":
        raise ExprSyntaxError(
            "a range vector cannot be the result; wrap it in a function such as rate() or avg_over_time()",
            node.line,
            node.column,
        )
    return node


def _describe(tok: Token) -> str:
    if tok.kind == "EOF":
        return "end of input"
    return f"{tok.kind.lower()} {tok.text!r}"


def _pos(tok: Token) -> dict[str, int]:
    return {"line": tok.line, "column": tok.column}


class _Parser:
    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.index = 0

    def peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.index + ahead, len(self.tokens) - 1)]

    def advance(self) -> Token:
        tok = self.peek()
        self.index += 1
        return tok

    def expect(self, kind: str, text: str | None = None, what: str | None = None) -> Token:
        tok = self.peek()
        if tok.kind != kind or (text is not None and tok.text != text):
            wanted = what or (repr(text) if text else kind.lower())
            raise ExprSyntaxError(f"expected {wanted}, found {_describe(tok)}", tok.line, tok.column)
        return self.advance()

    def _binary_op(self) -> str | None:
        tok = self.peek()
        if tok.kind == "OP" and tok.text in _PRECEDENCE:
            return tok.text
        if tok.kind == "KEYWORD" and tok.text in SET_OPS:
            return tok.text
        return None

    # --- binary expressions --------------------------------------------------------------------

    def expression(self, min_prec: int) -> Node:
        lhs = self.unary()
        while True:
            op = self._binary_op()
            if op is None or _PRECEDENCE[op] < min_prec:
                return lhs
            op_tok = self.advance()
            return_bool = False
            if self.peek().kind == "KEYWORD" and self.peek().text == "bool":
                bool_tok = self.advance()
                if op not in COMPARISONS:
                    raise ExprSyntaxError("bool modifier is only allowed on comparisons", **_pos(bool_tok))
                return_bool = True
            on = ignoring = group = None
            include: tuple[str, ...] = ()
            if self.peek().kind == "KEYWORD" and self.peek().text in ("on", "ignoring"):
                which = self.advance().text
                labels = self.label_list()
                on, ignoring = (labels, None) if which == "on" else (None, labels)
            if self.peek().kind == "KEYWORD" and self.peek().text in ("group_left", "group_right"):
                group_tok = self.advance()
                if on is None and ignoring is None:
                    raise ExprSyntaxError(
                        f"{group_tok.text} needs on(...) or ignoring(...) before it", **_pos(group_tok)
                    )
                group = group_tok.text.removeprefix("group_")
                if self.peek().kind == "OP" and self.peek().text == "(":
                    include = self.label_list()
            next_min = _PRECEDENCE[op] if op == "^" else _PRECEDENCE[op] + 1
            rhs = self.expression(next_min)
            node = Binary(op, lhs, rhs, return_bool, on, ignoring, group, include, **_pos(op_tok))
            lhs = self._check_binary(node)

    def _check_binary(self, node: Binary) -> Binary:
        lt, rt = value_type(node.lhs), value_type(node.rhs)
        for side, t in ((node.lhs, lt), (node.rhs, rt)):
            if t == "matrix":
                raise ExprSyntaxError(
                    f"a range vector cannot be an operand of {node.op!r}; wrap it in a "
                    "function such as avg_over_time()",
                    side.line,
                    side.column,
                )
        if node.op in SET_OPS and (lt != "vector" or rt != "vector"):
            raise ExprSyntaxError(f"{node.op!r} needs instant vectors on both sides", node.line, node.column)
        if node.op in COMPARISONS and lt == rt == "scalar" and not node.return_bool:
            raise ExprSyntaxError("comparisons between scalars must use the bool modifier", node.line, node.column)
        if (node.on is not None or node.ignoring is not None) and (lt != "vector" or rt != "vector"):
            raise ExprSyntaxError("on/ignoring only apply between two vectors", node.line, node.column)
        if node.group is not None and node.op in SET_OPS:
            raise ExprSyntaxError(f'no grouping allowed for "{node.op}" operation', node.line, node.column)
        if node.on is not None:
            for label in node.include:
                if label in node.on:
                    raise ExprSyntaxError(
                        f"label {label!r} must not occur in ON and GROUP clause at once", node.line, node.column
                    )
        return node

    def label_list(self) -> tuple[str, ...]:
        self.expect("OP", "(")
        labels: list[str] = []
        while not (self.peek().kind == "OP" and self.peek().text == ")"):
            tok = self.peek()
            if tok.kind not in ("IDENT", "KEYWORD") or not _LABEL_NAME.fullmatch(tok.text):
                raise ExprSyntaxError(f"expected a label name, found {_describe(tok)}", **_pos(tok))
            labels.append(self.advance().text)
            if self.peek().kind == "OP" and self.peek().text == ",":
                self.advance()
            elif not (self.peek().kind == "OP" and self.peek().text == ")"):
                raise ExprSyntaxError(f"expected ',' or ')', found {_describe(self.peek())}", **_pos(self.peek()))
        self.advance()
        return tuple(labels)

    # --- unary and primary ---------------------------------------------------------------------

    def unary(self) -> Node:
        tok = self.peek()
        if tok.kind == "OP" and tok.text in ("-", "+"):
            self.advance()
            operand = self.expression(_UNARY_PRECEDENCE + 1)
            if value_type(operand) == "matrix":
                raise ExprSyntaxError("unary minus cannot apply to a range vector", **_pos(tok))
            if isinstance(operand, NumberLiteral):
                value = -operand.value if tok.text == "-" else operand.value
                return NumberLiteral(value, **_pos(tok))
            return operand if tok.text == "+" else Unary("-", operand, **_pos(tok))
        return self.primary()

    def primary(self) -> Node:
        tok = self.peek()
        if tok.kind == "NUMBER":
            self.advance()
            text = tok.text
            return NumberLiteral(float(int(text, 16)) if text.lower().startswith("0x") else float(text), **_pos(tok))
        if tok.kind == "DURATION":
            raise ExprSyntaxError(
                f"unexpected duration {tok.text!r}; durations belong in [..] or after offset", **_pos(tok)
            )
        if tok.kind == "OP" and tok.text == "(":
            self.advance()
            inner = self.expression(0)
            self.expect("OP", ")")
            if self.peek().kind == "OP" and self.peek().text == "[":
                raise ExprSyntaxError(
                    "subqueries are not supported; apply the range to a series name", **_pos(self.peek())
                )
            return Paren(inner, **_pos(tok))
        if tok.kind == "OP" and tok.text == "{":
            raise ExprSyntaxError("a series name is required before '{'", **_pos(tok))
        if tok.kind == "IDENT":
            if tok.text in ("Inf", "inf", "NaN", "nan"):
                self.advance()
                return NumberLiteral(float(tok.text), **_pos(tok))
            nxt = self.peek(1)
            if tok.text in AGGREGATIONS and (
                (nxt.kind == "OP" and nxt.text == "(") or (nxt.kind == "KEYWORD" and nxt.text in ("by", "without"))
            ):
                return self.aggregate()
            if nxt.kind == "OP" and nxt.text == "(":
                return self.call()
            return self.selector()
        raise ExprSyntaxError(f"unexpected {_describe(tok)}", **_pos(tok))

    def call(self) -> Call:
        name_tok = self.advance()
        if name_tok.text not in FUNCTIONS:
            known = ", ".join(sorted(FUNCTIONS))
            raise ExprSyntaxError(f"unknown function {name_tok.text!r} (known: {known})", **_pos(name_tok))
        self.expect("OP", "(")
        args: list[Node] = []
        while not (self.peek().kind == "OP" and self.peek().text == ")"):
            args.append(self.expression(0))
            if self.peek().kind == "OP" and self.peek().text == ",":
                self.advance()
            elif not (self.peek().kind == "OP" and self.peek().text == ")"):
                raise ExprSyntaxError(f"expected ',' or ')', found {_describe(self.peek())}", **_pos(self.peek()))
        self.advance()
        wanted, _ = FUNCTIONS[name_tok.text]
        if len(args) != len(wanted):
            raise ExprSyntaxError(
                f"{name_tok.text}() takes {len(wanted)} argument(s), got {len(args)}", **_pos(name_tok)
            )
        for arg, want in zip(args, wanted, strict=True):
            got = value_type(arg)
            if got != want:
                hint = " (add a range such as [5m])" if want == "matrix" and got == "vector" else ""
                raise ExprSyntaxError(
                    f"{name_tok.text}() expects {_ARTICLE[want]} {_TYPE_NAMES[want]} here, got "
                    f"{_ARTICLE[got]} {_TYPE_NAMES[got]}{hint}",
                    arg.line,
                    arg.column,
                )
        return Call(name_tok.text, tuple(args), **_pos(name_tok))

    def aggregate(self) -> Aggregate:
        op_tok = self.advance()
        grouping: tuple[str, ...] = ()
        without = False
        seen_grouping = False
        if self.peek().kind == "KEYWORD" and self.peek().text in ("by", "without"):
            without = self.advance().text == "without"
            grouping = self.label_list()
            seen_grouping = True
        self.expect("OP", "(")
        param: Node | None = None
        first = self.expression(0)
        if op_tok.text == "quantile":
            self.expect("OP", ",", what="',' then the vector (quantile takes a scalar and a vector)")
            param, first = first, self.expression(0)
            if value_type(param) != "scalar":
                raise ExprSyntaxError("quantile's first argument must be a number", param.line, param.column)
        self.expect("OP", ")")
        if not seen_grouping and self.peek().kind == "KEYWORD" and self.peek().text in ("by", "without"):
            without = self.advance().text == "without"
            grouping = self.label_list()
        got = value_type(first)
        if got != "vector":
            raise ExprSyntaxError(
                f"{op_tok.text}() aggregates an instant vector, got {_ARTICLE[got]} {_TYPE_NAMES[got]}",
                first.line,
                first.column,
            )
        return Aggregate(op_tok.text, first, grouping, without, param, **_pos(op_tok))

    def selector(self) -> Node:
        name_tok = self.advance()
        matchers: list[Matcher] = []
        if self.peek().kind == "OP" and self.peek().text == "{":
            self.advance()
            while not (self.peek().kind == "OP" and self.peek().text == "}"):
                label_tok = self.peek()
                if label_tok.kind not in ("IDENT", "KEYWORD") or not _LABEL_NAME.fullmatch(label_tok.text):
                    raise ExprSyntaxError(f"expected a label name, found {_describe(label_tok)}", **_pos(label_tok))
                self.advance()
                op_tok = self.peek()
                if op_tok.kind != "OP" or op_tok.text not in _MATCH_OPS:
                    raise ExprSyntaxError(f"expected one of = != =~ !~, found {_describe(op_tok)}", **_pos(op_tok))
                self.advance()
                value_tok = self.expect("STRING", what="a quoted label value")
                if op_tok.text in ("=~", "!~"):
                    try:
                        check_regex(value_tok.text)
                    except RegexError as exc:
                        raise ExprSyntaxError(str(exc), **_pos(value_tok)) from None
                matchers.append(Matcher(label_tok.text, op_tok.text, value_tok.text))
                if self.peek().kind == "OP" and self.peek().text == ",":
                    self.advance()
                elif not (self.peek().kind == "OP" and self.peek().text == "}"):
                    raise ExprSyntaxError(f"expected ',' or '}}', found {_describe(self.peek())}", **_pos(self.peek()))
            self.advance()
        range_s: float | None = None
        if self.peek().kind == "OP" and self.peek().text == "[":
            self.advance()
            range_s = self.duration()
            if self.peek().kind == "OP" and self.peek().text == ":":
                raise ExprSyntaxError("subqueries are not supported", **_pos(self.peek()))
            self.expect("OP", "]")
            if range_s <= 0:
                raise ExprSyntaxError("range must be greater than zero", **_pos(name_tok))
        offset_s = 0.0
        if self.peek().kind == "KEYWORD" and self.peek().text == "offset":
            self.advance()
            negative = self.peek().kind == "OP" and self.peek().text == "-"
            if negative:
                self.advance()
            offset_s = -self.duration() if negative else self.duration()
        vector = VectorSelector(name_tok.text, tuple(matchers), offset_s, **_pos(name_tok))
        if range_s is not None:
            return MatrixSelector(vector, range_s, **_pos(name_tok))
        return vector

    def duration(self) -> float:
        tok = self.peek()
        if tok.kind == "NUMBER" and tok.text == "0":
            self.advance()
            return 0.0
        if tok.kind != "DURATION":
            raise ExprSyntaxError(f"expected a duration such as 5m, found {_describe(tok)}", **_pos(tok))
        self.advance()
        try:
            return parse_duration(tok.text)
        except DurationError as exc:
            raise ExprSyntaxError(str(exc), **_pos(tok)) from exc


_TYPE_NAMES = {"scalar": "number", "vector": "instant vector", "matrix": "range vector"}
_ARTICLE = {"scalar": "a", "vector": "an", "matrix": "a"}
