"""Overview and KV memory pages: an engine's load peaks come from every step, and each figure names its source.

A vLLM (steps from its iteration log, no sample events, KV usage scraped every 4 s) joins the seeded kvpilot
engines; its KV cache was 43 of 64 blocks full between two scrapes that read 0.238.
"""

from __future__ import annotations

from sqlalchemy import insert

from collector.db import make_engine
from collector.exposition import labels_json
from collector.queries.engine_peaks import VLLM_STEPS
from collector.schema import SeriesPoint
from dashboard import ui
from tests.collector import evfactory as ev
from tests.dashboard.conftest import no_exception, texts
from tests.dashboard.seed import T0, Seed, _ingest

USAGE = [5, 9, 12, 20, 31, 40, 43, 40, 30, 16] + [5] * 11  # blocks of 64, one step every 0.4 s from T0+96


def _add_vllm(url: str) -> None:
    engine = make_engine(url)
    try:
        _ingest(
            engine,
            [
                ev.step(i, instance="vllm-b", run_id="vllm-r", ts=T0 + 96 + 0.4 * i, kv_blocks_used=u,
                        kv_blocks_total=64, num_seqs=21 if u == 43 else 3, queue_depth=0)
                for i, u in enumerate(USAGE)
            ],
        )  # fmt: skip
        points = [("kv_usage", t, v) for t, v in ((96, 0.05), (100, 0.238), (104, 0.1))]
        points += [("queue_depth", t, v) for t, v in ((96, 0), (100, 4), (104, 0))]
        with engine.begin() as conn:
            conn.execute(
                insert(SeriesPoint.__table__),
                [
                    {"instance": "vllm-b", "name": n, "labels": labels_json({}), "ts": T0 + t, "value": v}
                    for n, t, v in points
                ],
            )
    finally:
        engine.dispose()


def test_overview_and_kv_page_show_the_step_peak_with_its_source(seeded: Seed, open_page) -> None:
    _add_vllm(seeded.url)
    at = open_page(seeded.url)
    no_exception(at)
    shown = texts(at)
    # the seed's scraped vLLM read 92% once: over every instance the highest figure is a sample, and says so
    assert "KV usage, highest sample **92.0%** (scrape samples every 15 s — sampled, not a peak)" in shown

    at.multiselect(key="f_instances").set_value(["vllm-b"]).run()
    no_exception(at)
    shown = texts(at)
    peak = ui.fmt_pct(43 / 64)
    assert f"KV usage peak **{peak}** ({VLLM_STEPS})" in shown
    assert f"Running peak **21** ({VLLM_STEPS})" in shown
    # vLLM's queue is sampled: the waiting figure says so and is not called a peak
    assert "waiting, highest sample **4** (scrape samples every 4 s — sampled, not a peak)" in shown
    specs = "\n".join(chart.proto.spec for chart in at.get("vega_lite_chart"))
    assert f"peak per 1 s over every step: {VLLM_STEPS}" in specs  # the KV and running charts' subtitles
    assert "highest sample per 1 s: sampled gauges" in specs  # vLLM's waiting line

    at = open_page(seeded.url, "kv_memory")
    at.multiselect(key="f_instances").set_value(["vllm-b"]).run()
    no_exception(at)
    assert f"KV usage peak **{peak}** ({VLLM_STEPS})" in texts(at)


def _chart_values(at, title: str) -> set[str]:
    """Every value in the datasets of the charts whose spec carries `title`."""
    from streamlit.dataframe_util import convert_arrow_bytes_to_pandas_df

    charts = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    assert charts, f"no chart titled {title!r}"
    frames = [convert_arrow_bytes_to_pandas_df(d.data.data) for c in charts for d in c.proto.datasets]
    return {str(v) for df in frames for col in df.columns for v in df[col].tolist()}


def test_a_fleet_is_drawn_as_its_envelope_and_its_top_engines(seeded: Seed, open_page) -> None:
    """15 kvpilot engines chosen: past a dozen, the load charts draw the fleet's peak and mean per bucket and the
    five engines of the highest peaks by name, not a line per engine."""
    names = [f"node-{i:02d}" for i in range(15)]
    engine = make_engine(seeded.url)
    try:
        _ingest(
            engine,
            [
                ev.step(100 * i + k, instance=name, run_id=f"run-{name}", ts=T0 + 96 + 0.4 * k,
                        kv_blocks_used=4 * i + k, kv_blocks_total=64, num_seqs=1 + i, queue_depth=i)
                for i, name in enumerate(names)
                for k in range(5)
            ]
            + [ev.sample(100 * i + 50, instance=n, run_id=f"run-{n}", ts=T0 + 96) for i, n in enumerate(names)],
        )  # fmt: skip
    finally:
        engine.dispose()
    at = open_page(seeded.url)
    at.multiselect(key="f_instances").set_value(names).run()
    no_exception(at)
    for title in ("KV cache usage (hot tier)", "Requests running and waiting"):
        values = _chart_values(at, title)
        assert {"fleet peak (15 engines)", "fleet mean (15 engines)"} <= values
        assert {"node-14", "node-13", "node-10"} <= values  # the highest peaks keep their own lines
        assert not {"node-00", "node-05", "node-09"} & values  # the others are in the envelope only
    assert f"KV usage peak **{ui.fmt_pct(60 / 64)}**" in texts(at)
