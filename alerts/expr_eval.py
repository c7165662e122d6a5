"""Evaluate an expression tree at one timestamp against a `SeriesSource`, with PromQL 2.x semantics.

A source answers one entry per stored label set (the name excluded); the evaluator adds `__name__`, so a
rule sees every GPU, engine and model as its own series, exactly as Prometheus would. Instant selectors
take the newest sample within the 5-minute lookback; ranges are closed `[t-r, t]`; `rate`/`increase`
extrapolate as Prometheus's extrapolatedRate does; comparisons filter unless `bool`; arithmetic and
functions drop the series name. Stale markers (a special NaN) end a series.

This module is the public surface; the work is in expr_select (selection), expr_match (binary operators
and vector matching) and expr_funcs (functions and aggregations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from alerts.expr_ast import Aggregate, Binary, Call, MatrixSelector, Node, NumberLiteral, Paren, Unary, VectorSelector
from alerts.expr_funcs import ELEMENTWISE, RANGE_FUNCS, aggregate, histogram_quantile, quantile, range_value, unique
from alerts.expr_match import binary
from alerts.expr_select import instant, instant_timestamps, matrix
from alerts.expr_values import (
    NAME,
    STALE_NAN,
    EvalError,
    Labels,
    LatestSource,
    Points,
    SeriesSource,
    Vector,
    drop_name,
    is_stale,
    labels_dict,
    newest_points,
)

__all__ = [
    "LOOKBACK_S",
    "NAME",
    "STALE_NAN",
    "CachingSource",
    "EvalError",
    "Evaluator",
    "Labels",
    "Points",
    "SeriesSource",
    "Vector",
    "drop_name",
    "is_stale",
    "labels_dict",
]
LOOKBACK_S = 300.0


class CachingSource:
    """Memoises `points` and `latest` calls within one evaluation round: rules repeat the same selectors. `latest`
    is the inner source's where it has one (`LatestSource`), else the newest of its `points`."""

    def __init__(self, inner: SeriesSource) -> None:
        self.inner = inner
        self._cache: dict[tuple, dict[Labels, Points]] = {}
        self._latest: dict[tuple, dict[Labels, tuple[float, float]]] = {}
        self.calls = 0

    def points(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, Points]:
        key = (name, start, end, tuple(instances) if instances is not None else None)
        hit = self._cache.get(key)
        if hit is None:
            self.calls += 1
            hit = self._cache[key] = self.inner.points(name, start, end, instances)
        return hit

    def latest(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, tuple[float, float]]:
        key = (name, start, end, tuple(instances) if instances is not None else None)
        hit = self._latest.get(key)
        if hit is None:
            if isinstance(self.inner, LatestSource):
                self.calls += 1
                hit = self.inner.latest(name, start, end, instances)
            else:
                hit = newest_points(self.points(name, start, end, instances))
            self._latest[key] = hit
        return hit


class Evaluator:
    def __init__(self, source: SeriesSource, lookback_s: float = LOOKBACK_S) -> None:
        self.source = source
        self.lookback_s = lookback_s

    def evaluate(self, node: Node, ts: float) -> Vector | float:
        return self._eval(node, ts)

    def _eval(self, node: Node, ts: float) -> Vector | float:
        if isinstance(node, NumberLiteral):
            return node.value
        if isinstance(node, VectorSelector):
            return instant(self.source, node, ts, self.lookback_s)
        if isinstance(node, Paren):
            return self._eval(node.expr, ts)
        if isinstance(node, Unary):
            inner = self._eval(node.expr, ts)
            if isinstance(inner, float):
                return -inner
            return unique({drop_name(k): -v for k, v in inner.items()}, len(inner), "unary minus")
        if isinstance(node, Call):
            return self._call(node, ts)
        if isinstance(node, Aggregate):
            param = self._scalar(node.param, ts) if node.param is not None else None
            return aggregate(node, self._vector(node.expr, ts), param)
        if isinstance(node, Binary):
            return binary(node, self._eval(node.lhs, ts), self._eval(node.rhs, ts))
        raise EvalError(f"cannot evaluate {type(node).__name__} on its own")

    def _call(self, node: Call, ts: float) -> Vector | float:
        name = node.func
        if name == "time":
            return float(ts)
        if name in RANGE_FUNCS or name in ("quantile_over_time", "absent_over_time"):
            return self._range_call(node, ts)
        if name == "vector":
            return {(): self._scalar(node.args[0], ts)}
        if name == "scalar":
            vec = self._vector(node.args[0], ts)
            return next(iter(vec.values())) if len(vec) == 1 else math.nan
        if name == "histogram_quantile":
            return histogram_quantile(self._scalar(node.args[0], ts), self._vector(node.args[1], ts))
        arg = node.args[0]
        if name == "absent":
            return {} if self._vector(arg, ts) else _absent_labels(arg)
        if name == "timestamp":
            if isinstance(arg, VectorSelector):
                return instant_timestamps(self.source, arg, ts, self.lookback_s)
            return {drop_name(k): float(ts) for k in self._vector(arg, ts)}
        vec = self._vector(arg, ts)
        extra = [self._scalar(a, ts) for a in node.args[1:]]
        fn = ELEMENTWISE[name]
        return unique({drop_name(k): fn(v, *extra) for k, v in vec.items()}, len(vec), name)

    def _range_call(self, node: Call, ts: float) -> Vector:
        name = node.func
        matrix_node = node.args[-1]
        assert isinstance(matrix_node, MatrixSelector)
        series = matrix(self.source, matrix_node, ts)
        if name == "absent_over_time":
            return {} if series else _absent_labels(matrix_node.selector)
        out: Vector = {}
        if name == "quantile_over_time":
            q = self._scalar(node.args[0], ts)
            for labels, _pts, values in series:
                out[drop_name(labels)] = quantile(q, values)
            return out
        end = ts - matrix_node.selector.offset_s
        keep_name = name == "last_over_time"
        for labels, pts, values in series:
            value = range_value(name, pts, values, end, matrix_node.range_s)
            if value is not None:
                out[labels if keep_name else drop_name(labels)] = value
        return out

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


def _absent_labels(sel: Node) -> Vector:
    """absent(x{a="b"}) is {a="b"}: the labels of the selector's equality matchers (not the name)."""
    if isinstance(sel, VectorSelector):
        pairs = {m.label: m.value for m in sel.matchers if m.op == "=" and m.label != NAME}
        return {tuple(sorted(pairs.items())): 1.0}
    return {(): 1.0}
