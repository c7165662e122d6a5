"""Binary operators between vectors and scalars, with Prometheus's vector matching (engine.go VectorBinop).

Two samples match when their signatures are equal: the `on(...)` labels, or every label but `ignoring(...)`
and the name (an absent label and an empty one are the same). One-to-one by default: each side may hold
one sample per signature. `group_left(l, ...)`: many samples on the left may share the signature of one on
the right; each result keeps the left sample's labels, plus `l, ...` copied from the right ("one") side.
`group_right` is the mirror. The errors are Prometheus's own, raised in the same cases:

- a duplicate signature on the "one" side: "found duplicate series for the match group ... many-to-many
  matching not allowed: matching labels must be unique on one side";
- one-to-one with two left samples matching one right sample: "multiple matches for labels: many-to-one
  matching must be explicit (group_left/group_right)";
- group_left/right results that collide: "multiple matches for labels: grouping labels must ensure
  unique matches".

Only samples that pass a filtering comparison count toward the last two, as in Prometheus. A comparison
keeps the left operand's value (the many side's under group_left); arithmetic and `bool` drop the name.
Set operators (`and`, `or`, `unless`) are many-to-many and never raise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from alerts.expr_ast import ARITHMETIC, COMPARISONS, Binary
from alerts.expr_funcs import unique
from alerts.expr_values import NAME, EvalError, Labels, Vector, drop_name

Signature = Callable[[Labels], Labels]


def binary(node: Binary, lhs: Vector | float, rhs: Vector | float) -> Vector | float:
    op = node.op
    if isinstance(lhs, float) and isinstance(rhs, float):
        value = apply(op, lhs, rhs)
        return (1.0 if value else 0.0) if op in COMPARISONS else value
    if isinstance(lhs, float) or isinstance(rhs, float):
        return _scalar_vector(node, lhs, rhs)
    if op in ("and", "or", "unless"):
        return _set_op(node, lhs, rhs)
    return _vector_vector(node, lhs, rhs)


def signature_of(node: Binary) -> Signature:
    if node.on is not None:
        on = frozenset(node.on)
        return lambda labels: tuple(p for p in labels if p[0] in on)
    if not node.ignoring:
        return drop_name
    ignored = frozenset((*node.ignoring, NAME))
    return lambda labels: tuple(p for p in labels if p[0] not in ignored)


def _vector_vector(node: Binary, lhs: Vector, rhs: Vector) -> Vector:
    if not lhs or not rhs:
        return {}
    op = node.op
    signature = signature_of(node)
    one_to_many = node.group == "right"
    many, one = (rhs, lhs) if one_to_many else (lhs, rhs)
    one_by_sig: dict[Labels, tuple[Labels, float]] = {}
    for labels, value in one.items():
        sig = signature(labels)
        dup = one_by_sig.get(sig)
        if dup is not None:
            raise EvalError(_many_to_many(sig, "left" if one_to_many else "right", labels, dup[0]))
        one_by_sig[sig] = (labels, value)
    comparison = op in COMPARISONS
    drop = op in ARITHMETIC or node.return_bool
    matched: dict[Labels, set[Labels] | None] = {}
    out: Vector = {}
    for labels, value in many.items():
        sig = signature(labels)
        match = one_by_sig.get(sig)
        if match is None:
            continue
        one_labels, one_value = match
        left, right = (one_value, value) if one_to_many else (value, one_value)
        result = apply(op, left, right)
        if comparison:
            if node.return_bool:
                result = 1.0 if result else 0.0
            elif not result:
                continue
            else:
                result = left
        metric = _result_labels(node, labels, one_labels, drop)
        if node.group is None:
            if sig in matched:
                raise EvalError(
                    "multiple matches for labels: many-to-one matching must be explicit (group_left/group_right)"
                )
            matched[sig] = None
        else:
            inserted = matched.setdefault(sig, set())
            assert inserted is not None
            if metric in inserted:
                raise EvalError("multiple matches for labels: grouping labels must ensure unique matches")
            inserted.add(metric)
        out[metric] = result
    return out


def _result_labels(node: Binary, many: Labels, one: Labels, drop: bool) -> Labels:
    labels = drop_name(many) if drop else many
    if node.group is None:
        if node.on is not None:
            return tuple(p for p in labels if p[0] in node.on)
        if node.ignoring:
            return tuple(p for p in labels if p[0] not in node.ignoring)
        return labels
    if not node.include:
        return labels
    merged = dict(labels)
    one_values = dict(one)
    for name in node.include:
        value = one_values.get(name, "")
        if value:
            merged[name] = value
        else:
            merged.pop(name, None)
    return tuple(sorted(merged.items()))


def _many_to_many(sig: Labels, side: str, series: Labels, other: Labels) -> str:
    later, earlier = sorted((series, other), reverse=True)  # Prometheus meets series in label order
    return (
        f"found duplicate series for the match group {_text(sig)} on the {side} hand-side of the operation: "
        f"[{_text(later)}, {_text(earlier)}];many-to-many matching not allowed: matching labels must be unique "
        "on one side"
    )


def _text(labels: Labels) -> str:
    """Prometheus's Labels.String(): {a="1", b="2"} with Go-quoted values."""
    return "{" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in labels) + "}"


def _set_op(node: Binary, lhs: Vector, rhs: Vector) -> Vector:
    signature = signature_of(node)
    if node.op == "and":
        if not lhs or not rhs:
            return {}
        rhs_sigs = {signature(labels) for labels in rhs}
        return {k: v for k, v in lhs.items() if signature(k) in rhs_sigs}
    if node.op == "unless":
        if not rhs:
            return lhs
        rhs_sigs = {signature(labels) for labels in rhs}
        return {k: v for k, v in lhs.items() if signature(k) not in rhs_sigs}
    lhs_sigs = {signature(labels) for labels in lhs}
    out = dict(lhs)
    for k, v in rhs.items():
        if signature(k) not in lhs_sigs:
            out[k] = v
    return out


def _scalar_vector(node: Binary, lhs: Vector | float, rhs: Vector | float) -> Vector:
    vector_on_left = isinstance(lhs, dict)
    vec = lhs if isinstance(lhs, dict) else rhs
    scalar = rhs if vector_on_left else lhs
    assert isinstance(vec, dict) and isinstance(scalar, float)
    op = node.op
    out: Vector = {}
    if op in COMPARISONS and not node.return_bool:
        for labels, value in vec.items():
            if apply(op, value, scalar) if vector_on_left else apply(op, scalar, value):
                out[labels] = value
        return out
    for labels, value in vec.items():
        result = apply(op, value, scalar) if vector_on_left else apply(op, scalar, value)
        out[drop_name(labels)] = float(result) if op in COMPARISONS else result
    return unique(out, len(vec), op)


def apply(op: str, a: float, b: float) -> float | bool:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1, b)
        return a / b
    if op == "%":
        return math.fmod(a, b) if b != 0 else math.nan
    if op == "^":
        try:
            return math.pow(a, b)
        except (OverflowError, ValueError):
            return math.inf if a > 0 else math.nan
    if op == "==":
        return a == b
    if op == "!=":
        return a != b
    if op == ">":
        return a > b
    if op == "<":
        return a < b
    if op == ">=":
        return a >= b
    if op == "<=":
        return a <= b
    raise EvalError(f"unknown operator {op!r}")
