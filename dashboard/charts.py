"""Altair chart builders: one look for every page (UTC time axis, tooltips, fixed heights, units in titles).

Data arrives already downsampled in SQL (one row per bucket), so charts never aggregate in the browser.
Time axes read 24-hour UTC (`HH:MM:SS`, with the date across days), never a 12-hour clock or a
millisecond tick. A bucket's value holds until the next bucket (a step), never a smoothed curve that
overshoots the data or dips below zero, and never across time with no data: a line breaks where its points
are more than `GAP_FACTOR` times their usual spacing apart (`break_gaps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import altair as alt
import pandas as pd

HEIGHT = 240
CLOCK = "%H:%M:%S"
DATE_CLOCK = "%m-%d %H:%M"
TIMESTAMP = "%Y-%m-%d %H:%M:%S"
# A bucket starts at its time and holds until the next: draw what was measured, nothing in between.
INTERPOLATE = "step-after"
GAP_FACTOR = 2.0


def break_gaps(df: pd.DataFrame, *, y: str, by: Sequence[str], time: str = "time") -> pd.DataFrame:
    """`df` with a row of no value (y = None) one usual spacing after each point that a gap follows.

    A gap is more than GAP_FACTOR times the line's median spacing between two points (a line of two
    points has no usual spacing: it is left whole). The empty row ends the last bucket where its own
    width would, and the chart's line stops there instead of drawing a level across time with no data.
    """
    if df.empty or time not in df:
        return df
    breaks = []
    for _, group in df.sort_values(time).groupby(list(by), sort=False, dropna=False):
        stamps = pd.to_datetime(group[time], utc=True)
        spacing = stamps.diff().iloc[1:]
        if len(spacing) < 2:
            continue
        usual = spacing.median()
        if usual <= pd.Timedelta(0):
            continue
        gap_next = [*(spacing > GAP_FACTOR * usual).to_list(), False]  # the point before each gap
        for _, row in group[gap_next].iterrows():
            empty = row.copy()
            empty[time] = row[time] + usual
            empty[y] = None
            breaks.append(empty)
    if not breaks:
        return df
    out = pd.concat([df, pd.DataFrame(breaks)], ignore_index=True).sort_values(time, kind="stable")
    out[y] = pd.to_numeric(out[y])  # NaN, which the chart's data carries as null: the line's break
    return out


def time_format(times: pd.Series | None) -> str:
    """HH:MM:SS within two days; month-day and HH:MM across a longer span."""
    if times is None or times.empty:
        return CLOCK
    span = pd.to_datetime(times, utc=True)
    return CLOCK if (span.max() - span.min()) <= pd.Timedelta(days=2) else DATE_CLOCK


def time_axis(times: pd.Series | None = None) -> alt.Axis:
    # tickMinStep (ms): no tick between whole seconds, so no ".500" labels on a short span.
    return alt.Axis(title=None, labelAngle=0, labelOverlap=True, format=time_format(times), tickMinStep=1000)


def time_x(df: pd.DataFrame, field: str = "time") -> alt.X:
    """The x encoding of a UTC time column, its labels in 24-hour UTC."""
    return alt.X(f"{field}:T", axis=time_axis(df.get(field)), scale=alt.Scale(type="utc"))


STAGE_COLORS = {
    "before the engine": "#bab0ac",
    "queue": "#f58518",
    "prefill": "#4c78a8",
    "first-token gap": "#b279a2",
    "decode": "#54a24b",
    "swap": "#e45756",
}
OP_COLORS = {
    "alloc": "#4c78a8",
    "free": "#9ecae9",
    "swap_out": "#e45756",
    "swap_in": "#f58518",
    "evict": "#b279a2",
    "recycle": "#54a24b",
    "oom": "#000000",
}


def _time_tooltip() -> alt.Tooltip:
    return alt.Tooltip("time:T", title="time (UTC)", format=TIMESTAMP, formatType="utc")


class Level(NamedTuple):
    """A horizontal line to draw that is not an alert rule's (a detector's threshold): level and its text."""

    level: float
    text: str


def lines(
    df: pd.DataFrame,
    *,
    y: str,
    color: str,
    title: str,
    y_title: str,
    y_format: str = "~s",
    percent: bool = False,
    dash: str | None = None,
    log: bool = False,
    height: int = HEIGHT,
    thresholds: Sequence[Any] = (),
    subtitle: str | None = None,
) -> alt.Chart | alt.LayerChart:
    """One line per `color` value over time (and per `dash` value, drawn dashed); `percent` formats 0..1 as %.

    `thresholds` (transform.Threshold: level, text) draw the levels alert rules fire at as dashed dark
    rules, so a reader sees a peak against the line that pages them. `subtitle`: where the data comes from.
    """
    df = break_gaps(df, y=y, by=[color, dash] if dash else [color])
    fmt = ".0%" if percent else y_format
    scale = alt.Scale(domain=[0, 1]) if percent else alt.Scale(zero=True)
    if log:
        scale = alt.Scale(type="symlog", constant=0.001)
    legend = alt.Legend(orient="bottom", title=None)
    tooltip = [_time_tooltip(), alt.Tooltip(f"{color}:N")]
    if dash:
        tooltip.append(alt.Tooltip(f"{dash}:N"))
    tooltip.append(alt.Tooltip(f"{y}:Q", format=".1%" if percent else ".4~g"))
    encoding: dict = {
        "x": time_x(df),
        "y": alt.Y(f"{y}:Q", title=y_title, axis=alt.Axis(format=fmt), scale=scale),
        "color": alt.Color(f"{color}:N", legend=legend),
        "tooltip": tooltip,
    }
    if dash:
        # The first series in the data (hot tier, p50, queue depth) solid, the others dashed.
        encoding["strokeDash"] = alt.StrokeDash(f"{dash}:N", legend=legend, sort=list(dict.fromkeys(df[dash])))
        encoding["detail"] = alt.Detail(f"{dash}:N")
    # A count's rule line far above the data would squash the lines into the axis: name it instead.
    top = float(df[y].max()) if not df.empty else 0.0
    drawn = [t for t in thresholds if percent or t.level <= 2 * top]
    far = [t for t in thresholds if t not in drawn]
    notes = ([subtitle] if subtitle else []) + [f"{t.text} (far above)" for t in far]
    heading = alt.TitleParams(title, subtitle=notes) if notes else title
    chart = (
        alt.Chart(df, title=heading, height=height)
        .mark_line(point=len(df) < 40, interpolate=INTERPOLATE)
        .encode(**encoding)
        .interactive(bind_y=False)
    )
    if not drawn:
        return chart
    levels = pd.DataFrame({y: [t.level for t in drawn], "rule": [t.text for t in drawn]})
    rule = alt.Chart(levels).mark_rule(color="#333333", strokeDash=[6, 4]).encode(y=f"{y}:Q", tooltip=["rule:N"])
    label = (
        alt.Chart(levels)
        .mark_text(align="right", baseline="bottom", dx=-2, dy=-2, color="#333333", fontSize=11)
        .encode(y=f"{y}:Q", x=alt.value(alt.ExprRef("width")), text="rule:N")
    )
    return alt.layer(chart, rule, label)


def stacked_stages(df: pd.DataFrame, *, title: str) -> alt.Chart:
    """Mean seconds per stage, stacked per bucket: the bar height is the mean end-to-end latency."""
    order = list(STAGE_COLORS)
    return (
        alt.Chart(df, title=title, height=HEIGHT + 40)
        .mark_bar()
        .encode(
            x=time_x(df),
            y=alt.Y("seconds:Q", title="seconds (mean)", stack="zero"),
            color=alt.Color(
                "stage:N",
                title=None,
                sort=order,
                legend=alt.Legend(orient="bottom"),
                scale=alt.Scale(domain=order, range=[STAGE_COLORS[s] for s in order]),
            ),
            order=alt.Order("stage_order:Q"),
            tooltip=[
                _time_tooltip(),
                "stage:N",
                alt.Tooltip("seconds:Q", format=".4~g"),
                alt.Tooltip("e2e (s):Q", format=".4~g", title="mean e2e (s)"),
                "requests:Q",
                "swaps:Q",
                "preemptions:Q",
            ],
        )
        .transform_calculate(stage_order=f"indexof({order!r}, datum.stage)")
    )


def histogram(df: pd.DataFrame, *, title: str, x_title: str) -> alt.Chart:
    return (
        alt.Chart(df, title=title, height=HEIGHT)
        .mark_bar(color="#4c78a8")
        .encode(
            x=alt.X("lo:Q", bin="binned", title=x_title, axis=alt.Axis(format="~g")),
            x2="hi:Q",
            y=alt.Y("count:Q", title="requests"),
            tooltip=[
                alt.Tooltip("lo:Q", format=".4~g", title="from (s)"),
                alt.Tooltip("hi:Q", format=".4~g", title="to (s)"),
                "count:Q",
            ],
        )
    )


def stacked_counts(
    df: pd.DataFrame, *, y: str, color: str, title: str, y_title: str, colors: dict[str, str] | None = None
) -> alt.Chart:
    present = [k for k in colors if k in set(df[color])] if colors else []
    scale = alt.Scale(domain=present, range=[colors[k] for k in present]) if colors else alt.Undefined
    return (
        alt.Chart(df, title=title, height=HEIGHT)
        .mark_bar()
        .encode(
            x=time_x(df),
            y=alt.Y(f"sum({y}):Q", title=y_title, stack="zero"),
            color=alt.Color(f"{color}:N", title=None, scale=scale, legend=alt.Legend(orient="bottom")),
            tooltip=[_time_tooltip(), f"{color}:N", alt.Tooltip(f"sum({y}):Q", title=y_title)],
        )
    )


def alloc_timeline(df: pd.DataFrame, *, title: str) -> alt.LayerChart:
    """Each allocation event as a mark on its op's row (size = blocks), over the hot-tier usage after it."""
    ops = [op for op in OP_COLORS if op in set(df["op"])]
    base = alt.Chart(df).encode(x=time_x(df))
    events = (
        base.mark_tick(thickness=2, size=14)
        .encode(
            y=alt.Y("op:N", title=None, sort=list(OP_COLORS)),
            color=alt.Color("op:N", scale=alt.Scale(domain=ops, range=[OP_COLORS[o] for o in ops]), legend=None),
            tooltip=[
                _time_tooltip(),
                "op:N",
                "tier:N",
                "request_id:N",
                "blocks:Q",
                "bytes:Q",
                alt.Tooltip("usage_after:Q", format=".1%"),
            ],
        )
        .properties(height=30 * max(1, len(ops)) + 20, title=title)
    )
    usage = (
        base.mark_line(interpolate="step-after", color="#555")
        .encode(
            y=alt.Y(
                "usage_after:Q",
                title="KV usage after event",
                axis=alt.Axis(format=".0%"),
                scale=alt.Scale(domain=[0, 1]),
            ),
            tooltip=[_time_tooltip(), alt.Tooltip("usage_after:Q", format=".1%")],
        )
        .properties(height=160)
    )
    zoom = alt.selection_interval(bind="scales", encodings=["x"], name="trace_zoom")
    return alt.vconcat(events.add_params(zoom), usage).resolve_scale(x="shared")


def history_line(df: pd.DataFrame, *, y: str, title: str, direction: str) -> alt.LayerChart:
    """Objective per trial (dots) with the best value so far (step line)."""
    points = (
        alt.Chart(df)
        .mark_circle(size=50, opacity=0.7)
        .encode(
            x=alt.X("trial:Q", title="trial", axis=alt.Axis(format="d", tickMinStep=1)),
            y=alt.Y(f"{y}:Q", title=y, scale=alt.Scale(zero=False)),
            tooltip=["trial:Q", alt.Tooltip(f"{y}:Q", format=".5~g")],
        )
    )
    best = (
        alt.Chart(df)
        .mark_line(interpolate="step-after", color="#e45756")
        .encode(
            x="trial:Q",
            y=alt.Y("best:Q"),
            tooltip=["trial:Q", alt.Tooltip("best:Q", format=".5~g", title=f"best ({direction})")],
        )
    )
    return alt.layer(points, best, title=title).properties(height=HEIGHT)


def pareto(df: pd.DataFrame, *, x: str, y: str, title: str) -> alt.Chart:
    return (
        alt.Chart(df, title=title, height=HEIGHT + 60)
        .mark_circle(size=70)
        .encode(
            x=alt.X(f"{x}:Q", title=x, scale=alt.Scale(zero=False)),
            y=alt.Y(f"{y}:Q", title=y, scale=alt.Scale(zero=False)),
            color=alt.Color(
                "front:N",
                title=None,
                scale=alt.Scale(domain=["Pareto front", "dominated"], range=["#e45756", "#bab0ac"]),
            ),
            tooltip=["trial:Q", alt.Tooltip(f"{x}:Q", format=".5~g"), alt.Tooltip(f"{y}:Q", format=".5~g")],
        )
    )


def importance_bars(df: pd.DataFrame, *, title: str) -> alt.Chart:
    return (
        alt.Chart(df, title=title, height=alt.Step(28))
        .mark_bar(color="#4c78a8")
        .encode(
            x=alt.X("importance:Q", title="importance (PED-ANOVA)", axis=alt.Axis(format=".0%")),
            y=alt.Y("parameter:N", sort="-x", title=None, axis=alt.Axis(labelLimit=320)),
            tooltip=["parameter:N", alt.Tooltip("importance:Q", format=".1%")],
        )
    )


def alert_timeline(df: pd.DataFrame, *, title: str) -> alt.Chart:
    """Pending and firing intervals per alert (a Gantt of the alert state rows)."""
    return (
        alt.Chart(df, title=title, height=alt.Step(28))
        .mark_bar(cornerRadius=2)
        .encode(
            x=alt.X("from:T", axis=time_axis(pd.concat([df["from"], df["to"]])), scale=alt.Scale(type="utc")),
            x2="to:T",
            y=alt.Y("alert:N", title=None, axis=alt.Axis(labelLimit=320)),
            color=alt.Color(
                "phase:N", title=None, scale=alt.Scale(domain=["pending", "firing"], range=["#f2cf5b", "#e45756"])
            ),
            tooltip=[
                "alert:N",
                "phase:N",
                alt.Tooltip("from:T", title="from (UTC)", format=TIMESTAMP, formatType="utc"),
                alt.Tooltip("to:T", title="to (UTC)", format=TIMESTAMP, formatType="utc"),
            ],
        )
    )
