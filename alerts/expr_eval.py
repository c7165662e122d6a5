"""Evaluate an expression tree at one timestamp against a `SeriesSource`, with PromQL 2.x semantics.

Instant selectors take the newest sample within the 5-minute lookback; ranges are closed `[t-r, t]`;
`rate`/`increase` extrapolate as Prometheus's extrapolatedRate does; comparisons filter unless `bool`;
arithmetic and functions drop the series name. Stale markers (a special NaN) end a series.
"""

from __future__ import annotations

import math
import re
import statistics
import struct
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from alerts.expr_ast import (
    ARITHMETIC,
    COMPARISONS,
    Aggregate,
    Binary,
    Call,
    MatrixSelector,
    Node,
    NumberLiteral,
    Paren,
    Unary,
    VectorSelector,
)

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]
Points = list[tuple[float, float]]
LOOKBACK_S = 300.0
STALE_NAN = struct.unpack(">d", bytes.fromhex("7ff0000000000002"))[0]
NAME = "__name__"


def is_stale(value: float) -> bool:
    return math.isnan(value) and struct.pack(">d", value) == b"\x7f\xf0\x00\x00\x00\x00\x00\x02"


class EvalError(RuntimeError):
    """An expression that parsed but cannot be computed on this data (e.g. duplicate label sets)."""


@runtime_checkable
class SeriesSource(Protocol):
    def points(self, name: str, start: float, end: float, instances: Sequence[str] | None = None) -> dict[str, Points]:
        """Samples of canonical series `name` with start <= ts <= end, by instance, oldest first."""


class CachingSource:
    """Memoises `points` calls within one evaluation round: rules repeat the same selectors."""

    def __init__(self, inner: SeriesSource) -> None:
        self.inner = inner
        self._cache: dict[tuple, dict[str, Points]] = {}
        self.calls = 0

    def points(self, name: str, start: float, end: float, instances: Sequence[str] | None = None) -> dict[str, Points]:
        key = (name, start, end, tuple(instances) if instances is not None else None)
        hit = self._cache.get(key)
        if hit is None:
            self.calls += 1
            hit = self._cache[key] = self.inner.points(name, start, end, instances)
        return hit


def _labels(**pairs: str) -> Labels:
    return tuple(sorted(pairs.items()))


def drop_name(labels: Labels) -> Labels:
    return tuple(p for p in labels if p[0] != NAME)


def labels_dict(labels: Labels) -> dict[str, str]:
    return dict(labels)


class Evaluator:
    def __init__(self, source: SeriesSource, lookback_s: float = LOOKBACK_S) -> None:
        self.source = source
        self.lookback_s = lookback_s

    def evaluate(self, node: Node, ts: float) -> Vector | float:
        return self._eval(node, ts)

    # --- selection -----------------------------------------------------------------------------

    def _fetch(self, sel: VectorSelector, start: float, end: float) -> dict[str, Points]:
        exact = [m.value for m in sel.matchers if m.op == "="]
        instances = exact[:1] if exact else None
        raw = self.source.points(sel.name, start, end, instances)
        out: dict[str, Points] = {}
        for instance, pts in raw.items():
            if all(_match(m.op, m.value, instance) for m in sel.matchers):
                out[instance] = pts
        return out

    def _select(self, sel: VectorSelector, ts: float) -> Vector:
        t = ts - sel.offset_s
        out: Vector = {}
        for instance, pts in self._fetch(sel, t - self.lookback_s, t).items():
            last = None
            for pt_ts, value in reversed(pts):
                if t - self.lookback_s < pt_ts <= t:
                    last = value
                    break
            if last is not None and not is_stale(last):
                out[_labels(__name__=sel.name, instance=instance)] = last
        return out

    def _select_range(self, node: MatrixSelector, ts: float) -> list[tuple[Labels, Points]]:
        sel = node.selector
        end = ts - sel.offset_s
        start = end - node.range_s
        result = []
        for instance, pts in self._fetch(sel, start, end).items():
            kept = [(t, v) for t, v in pts if start <= t <= end and not is_stale(v)]
            if kept:
                result.append((_labels(__name__=sel.name, instance=instance), kept))
        return result

    # --- nodes ---------------------------------------------------------------------------------

    def _eval(self, node: Node, ts: float) -> Vector | float:
        if isinstance(node, NumberLiteral):
            return node.value
        if isinstance(node, VectorSelector):
            return self._select(node, ts)
        if isinstance(node, Paren):
            return self._eval(node.expr, ts)
        if isinstance(node, Unary):
            inner = self._eval(node.expr, ts)
            if isinstance(inner, float):
                return -inner
            return _unique({drop_name(k): -v for k, v in inner.items()}, len(inner), "unary minus")
        if isinstance(node, Call):
            return self._call(node, ts)
        if isinstance(node, Aggregate):
            return self._aggregate(node, ts)
        if isinstance(node, Binary):
            return self._binary(node, ts)
        raise EvalError(f"cannot evaluate {type(node).__name__} on its own")

    def _call(self, node: Call, ts: float) -> Vector | float:
        name = node.func
        if name == "time":
            return float(ts)
        if name in _RANGE_FUNCS or name in ("quantile_over_time", "absent_over_time"):
            matrix_node = node.args[-1]
            assert isinstance(matrix_node, MatrixSelector)
            matrix = self._select_range(matrix_node, ts)
            if name == "absent_over_time":
                return {} if matrix else _absent_labels(matrix_node.selector)
            out: Vector = {}
            if name == "quantile_over_time":
                q = self._scalar(node.args[0], ts)
                for labels, pts in matrix:
                    out[drop_name(labels)] = _quantile(q, [v for _, v in pts])
                return out
            for labels, pts in matrix:
                value = self._range_value(name, pts, matrix_node, ts)
                if value is not None:
                    out[labels if name == "last_over_time" else drop_name(labels)] = value
            return out
        if name == "vector":
            return {(): self._scalar(node.args[0], ts)}
        if name == "scalar":
            vec = self._vector(node.args[0], ts)
            return next(iter(vec.values())) if len(vec) == 1 else math.nan
        if name == "absent":
            vec = self._vector(node.args[0], ts)
            arg = node.args[0]
            return {} if vec else (_absent_labels(arg) if isinstance(arg, VectorSelector) else {(): 1.0})
        vec = self._vector(node.args[0], ts)
        if name == "timestamp":
            return self._timestamps(node.args[0], ts, vec)
        extra = [self._scalar(a, ts) for a in node.args[1:]]
        fn = _ELEMENTWISE[name]
        return _unique({drop_name(k): fn(v, *extra) for k, v in vec.items()}, len(vec), name)

    def _timestamps(self, arg: Node, ts: float, vec: Vector) -> Vector:
        if not isinstance(arg, VectorSelector):
            return {drop_name(k): float(ts) for k in vec}
        t = ts - arg.offset_s
        out: Vector = {}
        for instance, pts in self._fetch(arg, t - self.lookback_s, t).items():
            for pt_ts, value in reversed(pts):
                if t - self.lookback_s < pt_ts <= t:
                    if not is_stale(value):
                        out[_labels(instance=instance)] = pt_ts
                    break
        return out

    def _range_value(self, name: str, pts: Points, node: MatrixSelector, ts: float) -> float | None:
        values = [v for _, v in pts]
        if name == "avg_over_time":
            return math.fsum(values) / len(values)
        if name == "max_over_time":
            return max(values)
        if name == "min_over_time":
            return min(values)
        if name == "sum_over_time":
            return math.fsum(values)
        if name == "count_over_time":
            return float(len(values))
        if name == "last_over_time":
            return values[-1]
        if name == "irate":
            if len(pts) < 2:
                return None
            (t0, v0), (t1, v1) = pts[-2], pts[-1]
            delta = v1 - v0 if v1 >= v0 else v1
            return delta / (t1 - t0) if t1 > t0 else None
        end = ts - node.selector.offset_s
        return _extrapolated(
            pts, end - node.range_s, end, node.range_s, is_counter=name != "delta", is_rate=name == "rate"
        )

    def _aggregate(self, node: Aggregate, ts: float) -> Vector:
        vec = self._vector(node.expr, ts)
        groups: dict[Labels, list[float]] = {}
        for labels, value in vec.items():
            if node.without:
                key = tuple(p for p in labels if p[0] not in node.grouping and p[0] != NAME)
            else:
                key = tuple(p for p in labels if p[0] in node.grouping)
            groups.setdefault(key, []).append(value)
        param = self._scalar(node.param, ts) if node.param is not None else None
        return {key: _AGGREGATORS[node.op](values, param) for key, values in groups.items()}

    def _binary(self, node: Binary, ts: float) -> Vector | float:
        lhs = self._eval(node.lhs, ts)
        rhs = self._eval(node.rhs, ts)
        op = node.op
        if isinstance(lhs, float) and isinstance(rhs, float):
            value = _apply(op, lhs, rhs)
            return (1.0 if value else 0.0) if op in COMPARISONS else value  # type: ignore[return-value]
        if op in ("and", "or", "unless"):
            assert isinstance(lhs, dict) and isinstance(rhs, dict)
            return _set_op(node, lhs, rhs)
        if isinstance(lhs, float) or isinstance(rhs, float):
            return self._scalar_vector(node, lhs, rhs)
        assert isinstance(lhs, dict) and isinstance(rhs, dict)
        rhs_by_sig: dict[Labels, tuple[Labels, float]] = {}
        for labels, value in rhs.items():
            sig = _signature(node, labels)
            if sig in rhs_by_sig:
                raise EvalError(
                    f"many-to-many matching not allowed: duplicate series for {dict(sig)} on the right side of {op!r}"
                )
            rhs_by_sig[sig] = (labels, value)
        out: Vector = {}
        seen: set[Labels] = set()
        for labels, lvalue in lhs.items():
            sig = _signature(node, labels)
            match = rhs_by_sig.get(sig)
            if match is None:
                continue
            if sig in seen:
                raise EvalError(
                    f"many-to-many matching not allowed: duplicate series for {dict(sig)} on the left side of {op!r}"
                )
            seen.add(sig)
            result = _apply(op, lvalue, match[1])
            key = labels
            if node.on is not None:
                key = tuple(p for p in labels if p[0] in node.on)
            elif node.ignoring is not None:
                key = tuple(p for p in labels if p[0] not in node.ignoring)
            if op in ARITHMETIC or node.return_bool:
                key = drop_name(key)
            if op in COMPARISONS:
                if node.return_bool:
                    out[key] = 1.0 if result else 0.0
                elif result:
                    out[key] = lvalue
            else:
                out[key] = result  # type: ignore[assignment]
        return out

    def _scalar_vector(self, node: Binary, lhs: Vector | float, rhs: Vector | float) -> Vector:
        vector_on_left = isinstance(lhs, dict)
        vec = lhs if isinstance(lhs, dict) else rhs
        scalar = rhs if vector_on_left else lhs
        assert isinstance(vec, dict) and isinstance(scalar, float)
        out: Vector = {}
        for labels, value in vec.items():
            a, b = (value, scalar) if vector_on_left else (scalar, value)
            result = _apply(node.op, a, b)
            if node.op in COMPARISONS:
                if node.return_bool:
                    out[drop_name(labels)] = 1.0 if result else 0.0
                elif result:
                    out[labels] = value
            else:
                out[drop_name(labels)] = result  # type: ignore[assignment]
        return _unique(out, len(out), node.op)

    def _vector(self, node: Node, ts: float) -> Vector:
        value = self._eval(node, ts)
        if not isinstance(value, dict):
            raise EvalError("expected an instant vector")
        return value

    def _scalar(self, node: Node, ts: float) -> float:
        value = self._eval(node, ts)
        if not isinstance(value, float):
            raise EvalError("expected a number")
        return value


def _match(op: str, pattern: str, value: str) -> bool:
    if op == "=":
        return value == pattern
    if op == "!=":
        return value != pattern
    full = re.fullmatch(pattern, value) is not None
    return full if op == "=~" else not full


def _absent_labels(sel: Node) -> Vector:
    if isinstance(sel, VectorSelector):
        pairs = {m.label: m.value for m in sel.matchers if m.op == "="}
        return {tuple(sorted(pairs.items())): 1.0}
    return {(): 1.0}


def _unique(out: Vector, expected: int, what: str) -> Vector:
    if len(out) != expected:
        raise EvalError(f"{what}: vector cannot contain series with the same label set after dropping the name")
    return out


def _signature(node: Binary, labels: Labels) -> Labels:
    if node.on is not None:
        return tuple(p for p in labels if p[0] in node.on)
    ignored = set(node.ignoring or ())
    return tuple(p for p in labels if p[0] != NAME and p[0] not in ignored)


def _set_op(node: Binary, lhs: Vector, rhs: Vector) -> Vector:
    rhs_sigs = {_signature(node, labels) for labels in rhs}
    if node.op == "and":
        return {k: v for k, v in lhs.items() if _signature(node, k) in rhs_sigs}
    if node.op == "unless":
        return {k: v for k, v in lhs.items() if _signature(node, k) not in rhs_sigs}
    lhs_sigs = {_signature(node, labels) for labels in lhs}
    out = dict(lhs)
    for k, v in rhs.items():
        if _signature(node, k) not in lhs_sigs:
            out[k] = v
    return out


def _apply(op: str, a: float, b: float) -> float | bool:
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


def _extrapolated(
    pts: Points, range_start: float, range_end: float, range_s: float, *, is_counter: bool, is_rate: bool
) -> float | None:
    if len(pts) < 2:
        return None
    first_t, first_v = pts[0]
    last_t, last_v = pts[-1]
    result = last_v - first_v
    if is_counter:
        previous = 0.0
        for _, value in pts:
            if value < previous:
                result += previous
            previous = value
    to_start = first_t - range_start
    to_end = range_end - last_t
    sampled = last_t - first_t
    if sampled <= 0:
        return None
    average_step = sampled / (len(pts) - 1)
    if is_counter and result > 0 and first_v >= 0:
        to_zero = sampled * (first_v / result)
        to_start = min(to_start, to_zero)
    threshold = average_step * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average_step / 2
    interval += to_end if to_end < threshold else average_step / 2
    result *= interval / sampled
    return result / range_s if is_rate else result


def _quantile(q: float, values: list[float]) -> float:
    if not values:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    weight = rank - lower
    return ordered[lower] * (1 - weight) + ordered[upper] * weight


def _stdvar(values: list[float], _param: float | None) -> float:
    return statistics.pvariance(values) if len(values) > 1 else 0.0


_RANGE_FUNCS = frozenset(
    {
        "rate",
        "irate",
        "increase",
        "delta",
        "avg_over_time",
        "max_over_time",
        "min_over_time",
        "sum_over_time",
        "count_over_time",
        "last_over_time",
    }
)
_ELEMENTWISE: dict[str, Callable[..., float]] = {
    "abs": abs,
    "ceil": lambda v: float(math.ceil(v)) if math.isfinite(v) else v,
    "floor": lambda v: float(math.floor(v)) if math.isfinite(v) else v,
    "clamp_min": lambda v, lo: max(v, lo) if not math.isnan(v) else v,
    "clamp_max": lambda v, hi: min(v, hi) if not math.isnan(v) else v,
    "clamp": lambda v, lo, hi: math.nan if lo > hi else (max(lo, min(hi, v)) if not math.isnan(v) else v),
}
_AGGREGATORS: dict[str, Callable[[list[float], float | None], float]] = {
    "sum": lambda vs, _p: math.fsum(vs),
    "avg": lambda vs, _p: math.fsum(vs) / len(vs),
    "min": lambda vs, _p: min(vs),
    "max": lambda vs, _p: max(vs),
    "count": lambda vs, _p: float(len(vs)),
    "group": lambda vs, _p: 1.0,
    "stdvar": _stdvar,
    "stddev": lambda vs, p: math.sqrt(_stdvar(vs, p)),
    "quantile": lambda vs, p: _quantile(p if p is not None else math.nan, vs),
}
