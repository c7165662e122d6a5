"""The expression tree. Nodes are frozen dataclasses; `line`/`column` point into the expression text.

Value types follow PromQL: "scalar", "vector" (instant vector: one sample per label set) and "matrix"
(range vector, only as a function argument). The parser checks types, so evaluation never meets a
range vector where a number was meant.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Node:
    line: int = field(default=0, compare=False, kw_only=True)
    column: int = field(default=0, compare=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class NumberLiteral(Node):
    value: float


@dataclass(frozen=True, slots=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str


@dataclass(frozen=True, slots=True)
class VectorSelector(Node):
    name: str
    matchers: tuple[Matcher, ...] = ()
    offset_s: float = 0.0


@dataclass(frozen=True, slots=True)
class MatrixSelector(Node):
    selector: VectorSelector
    range_s: float


@dataclass(frozen=True, slots=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Aggregate(Node):
    op: str
    expr: Node
    grouping: tuple[str, ...] = ()
    without: bool = False
    param: Node | None = None


@dataclass(frozen=True, slots=True)
class Binary(Node):
    op: str
    lhs: Node
    rhs: Node
    return_bool: bool = False
    on: tuple[str, ...] | None = None
    ignoring: tuple[str, ...] | None = None
    group: str | None = None  # "left" | "right": many-to-one / one-to-many matching
    include: tuple[str, ...] = ()  # labels group_left/right copy from the "one" side


@dataclass(frozen=True, slots=True)
class Unary(Node):
    op: str
    expr: Node


@dataclass(frozen=True, slots=True)
class Paren(Node):
    expr: Node


# name -> (argument types, return type). "scalar?" is an optional trailing scalar.
FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "rate": (("matrix",), "vector"),
    "irate": (("matrix",), "vector"),
    "increase": (("matrix",), "vector"),
    "delta": (("matrix",), "vector"),
    "avg_over_time": (("matrix",), "vector"),
    "max_over_time": (("matrix",), "vector"),
    "min_over_time": (("matrix",), "vector"),
    "sum_over_time": (("matrix",), "vector"),
    "count_over_time": (("matrix",), "vector"),
    "last_over_time": (("matrix",), "vector"),
    "quantile_over_time": (("scalar", "matrix"), "vector"),
    "histogram_quantile": (("scalar", "vector"), "vector"),
    "absent_over_time": (("matrix",), "vector"),
    "abs": (("vector",), "vector"),
    "ceil": (("vector",), "vector"),
    "floor": (("vector",), "vector"),
    "clamp_min": (("vector", "scalar"), "vector"),
    "clamp_max": (("vector", "scalar"), "vector"),
    "clamp": (("vector", "scalar", "scalar"), "vector"),
    "absent": (("vector",), "vector"),
    "timestamp": (("vector",), "vector"),
    "time": ((), "scalar"),
    "vector": (("scalar",), "vector"),
    "scalar": (("vector",), "scalar"),
}
AGGREGATIONS = frozenset({"sum", "avg", "min", "max", "count", "group", "quantile", "stddev", "stdvar"})
COMPARISONS = frozenset({"==", "!=", ">", "<", ">=", "<="})
SET_OPS = frozenset({"and", "or", "unless"})
ARITHMETIC = frozenset({"+", "-", "*", "/", "%", "^"})


def value_type(node: Node) -> str:
    """The PromQL type of a (parser-checked) node."""
    if isinstance(node, NumberLiteral):
        return "scalar"
    if isinstance(node, VectorSelector | Aggregate):
        return "vector"
    if isinstance(node, MatrixSelector):
        return "matrix"
    if isinstance(node, Call):
        return FUNCTIONS[node.func][1]
    if isinstance(node, Unary | Paren):
        return value_type(node.expr)
    if isinstance(node, Binary):
        if value_type(node.lhs) == "scalar" and value_type(node.rhs) == "scalar":
            return "scalar"
        return "vector"
    raise TypeError(f"not an expression node: {node!r}")


def selectors(node: Node) -> list[VectorSelector]:
    """Every series selector in the tree (for validation against the canonical names)."""
    out: list[VectorSelector] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, VectorSelector):
            out.append(cur)
        elif isinstance(cur, MatrixSelector):
            out.append(cur.selector)
        elif isinstance(cur, Call):
            stack.extend(cur.args)
        elif isinstance(cur, Aggregate):
            stack.append(cur.expr)
            if cur.param is not None:
                stack.append(cur.param)
        elif isinstance(cur, Binary):
            stack.extend((cur.lhs, cur.rhs))
        elif isinstance(cur, Unary | Paren):
            stack.append(cur.expr)
    return out
