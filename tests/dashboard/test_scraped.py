"""Scraped-only instances on every page: listed with their labels, gauges per label set (never averaged over
GPUs), percentiles from histogram buckets, and a notice where a figure needs per-request events."""

from __future__ import annotations

import pytest

from dashboard import ui
from tests.dashboard.conftest import metrics, no_exception, texts
from tests.dashboard.seed import Seed
from tests.dashboard.seed_scraped import (
    ENGINE_STEP,
    GPU_MEMORY,
    PREFIX_HITS,
    PREFIX_LOOKUPS,
    SCRAPE_S,
    SCRAPES,
)

# Both engines' TTFT buckets merged, 19 scrape intervals of 15 observations each (seed_scraped.py):
# cumulative 0.025 -> 114, 0.05 -> 171, 0.25 -> 190, 0.5 -> 247, 1.0 -> 266, 2.5 -> 285.
# p50: rank 142.5 in (0.025, 0.05]: 0.025 + 0.025 * 28.5 / 57; p90: rank 256.5 in (0.5, 1]: 0.5 + 0.5 * 9.5 / 19;
# p99: rank 282.15 in (1, 2.5]: 1 + 1.5 * 16.15 / 19.
TTFT_P50, TTFT_P90, TTFT_P99 = 0.0375, 0.75, 2.275
INTERVALS = SCRAPES - 1
NEEDS_EVENTS = "need per-request events"


def _per_instance(at):
    """The overview's two per-instance tables (traffic and latency; the newest gauges) side by side."""
    traffic = _table(at, "requests").set_index("instance")
    now = _table(at, "KV usage").set_index("instance")
    return traffic.join(now, how="outer")


def _table(at, column: str):
    """The first dataframe on the page with this column."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def test_scraped_instances_are_listed_with_their_labels(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    no_exception(at)
    options = at.multiselect(key="f_instances").options
    assert "dcgm-node1 · scrape · job=dcgm · node=node-1" in options
    assert "vllm-a · scrape · job=vllm" in options
    assert "e0 · push" in options


def test_overview_shows_what_a_scrape_gives(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    no_exception(at)
    table = _per_instance(at)
    assert "gpu-b" not in table.index  # a down target with nothing scraped in the window
    vllm = table.loc["vllm-a"]
    assert vllm["source"] == "scrape" and vllm["labels"] == "job=vllm"
    per_interval = {e: step for e, step in ENGINE_STEP.items()}
    assert vllm["requests"] == INTERVALS * sum(s[3] + s[4] for s in per_interval.values())
    assert vllm["failed"] == INTERVALS * sum(s[4] for s in per_interval.values())  # finished_reason=abort
    assert vllm["output tok/s"] == pytest.approx(sum(s[5] for s in per_interval.values()) / SCRAPE_S)
    assert vllm["preemptions"] == INTERVALS * sum(s[7] for s in per_interval.values())
    assert vllm["TTFT p50 (s)"] == pytest.approx(TTFT_P50)
    assert vllm["TTFT p99 (s)"] == pytest.approx(TTFT_P99)
    assert vllm["queue depth"] == sum(s[0] for s in per_interval.values())  # queues add up
    assert vllm["KV usage"] == pytest.approx(max(s[2] for s in per_interval.values()))  # the fullest engine
    gpus = table.loc["dcgm-node1"]
    assert gpus["source"] == "scrape" and gpus["labels"] == "job=dcgm · node=node-1"
    assert gpus["memory"] == pytest.approx(0.95)  # the full GPU, not the 85% average
    assert gpus["utilization"] == pytest.approx(0.9)
    assert gpus[["requests", "req/s", "output tok/s"]].isna().all()  # an exporter serves no requests

    accelerators = _table(at, "memory peak").set_index("labels")
    assert len(accelerators) == len(GPU_MEMORY)
    for gpu, fraction in GPU_MEMORY.items():
        row = accelerators.loc[f"Hostname=node-1 · UUID=GPU-0000000{gpu} · gpu={gpu} · node=node-1"]
        assert row["memory"] == pytest.approx(fraction) and row["memory peak"] == pytest.approx(fraction)
    assert sorted(accelerators["memory"]) == pytest.approx([0.75, 0.95])
    engines = _table(at, "KV peak").set_index("labels")
    assert engines.loc["engine=0 · model_name=m", "KV usage"] == pytest.approx(0.92)
    assert engines.loc["engine=1 · model_name=m", "queue depth"] == 1
    assert engines.loc["engine=0 · model_name=m", "preemptions"] == INTERVALS


def test_a_scraped_only_selection_shows_scrape_figures(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    at.multiselect(key="f_instances").set_value(["vllm-a"]).run()
    no_exception(at)
    shown = metrics(at)
    assert shown["Requests"] == f"{INTERVALS * 15:,}"
    assert "ITL p99" in shown  # from histograms, not TPOT from request events
    assert shown["TTFT p99"] == ui.fmt_s(TTFT_P99)
    assert shown["Not finished"] == str(INTERVALS)  # finished_reason=abort
    assert list(at.dataframe[0].value["instance"]) == ["vllm-a"]


def test_latency_page_percentiles_from_buckets(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "latency")
    no_exception(at)
    hist = _table(at, "observations").set_index(["instance", "metric"])
    row = hist.loc[("vllm-a", "TTFT")]
    assert row["observations"] == INTERVALS * 15
    assert (row["p50 (s)"], row["p90 (s)"], row["p99 (s)"]) == pytest.approx((TTFT_P50, TTFT_P90, TTFT_P99))
    # The pushed instances' exact percentiles are still there, and the scraped one is named.
    assert "Slowest requests" in [s.value for s in at.subheader]
    assert NEEDS_EVENTS in texts(at) and "`vllm-a`" in texts(at)
    assert "`dcgm-node1`" not in texts(at)  # a GPU exporter serves no requests: not named as missing them


def test_scraped_only_latency_page_says_which_source_gives_per_request_figures(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "latency")
    at.multiselect(key="f_instances").set_value(["vllm-a"]).run()
    no_exception(at)
    said = texts(at)
    assert NEEDS_EVENTS in said and "OpenTelemetry traces" in said and "kvpilot's engine" in said
    assert "No finished requests" not in said  # a notice, not an empty chart
    assert not [s for s in at.subheader if s.value in ("Where the time goes", "Slowest requests")]
    row = _table(at, "observations").set_index("metric").loc["TTFT"]
    assert row["p99 (s)"] == pytest.approx(TTFT_P99)


def test_kv_page_for_a_scraped_only_instance(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "kv_memory")
    at.multiselect(key="f_instances").set_value(["vllm-a", "dcgm-node1"]).run()
    no_exception(at)
    said = texts(at)
    assert "Internal waste, fragmentation and the KV allocation trace need per-request events" in said
    assert "telemetry.trace_alloc" in said
    assert "No allocation events" not in said
    engines = _table(at, "KV peak")
    assert sorted(engines["KV usage"]) == pytest.approx([0.40, 0.92])


def test_kv_page_advice_for_a_vllm_with_prefix_caching_on_names_vllm(seeded: Seed, open_page) -> None:
    """vLLM with `--enable-prefix-caching` has no hit-rate gauge: the page says the cache is on and gives the hit
    share from vLLM's counters, never kvpilot's config key."""
    at = open_page(seeded.url, "kv_memory")
    at.multiselect(key="f_instances").set_value(["vllm-a"]).run()
    no_exception(at)
    said = texts(at)
    assert "`vllm-a`: prefix caching is on (vLLM `--enable-prefix-caching`)" in said
    assert f"{PREFIX_HITS / PREFIX_LOOKUPS:.0%} of {2 * PREFIX_LOOKUPS * INTERVALS:,} prompt tokens" in said
    assert "cache.enable_prefix_cache" not in said


def test_gpu_lines_are_named_by_what_tells_them_apart(seeded: Seed, open_page) -> None:
    from dashboard.data import serving

    at = open_page(seeded.url)
    f = at.session_state[ui.FILTERS_KEY]
    memory = serving.gauges(f, ("memory_usage",), agg="max")
    peaks = memory[memory["instance"] == "dcgm-node1"].groupby("line")["value"].max().to_dict()
    assert peaks == pytest.approx({"dcgm-node1 · gpu=0": 0.95, "dcgm-node1 · gpu=1": 0.75})
    kv = serving.gauges(f, ("kv_usage",), agg="max")
    assert {"e0", "e1", "vllm-a · engine=0", "vllm-a · engine=1"} == set(kv["line"])


def test_scraped_figures_on_both_backends(db_url: str, open_page) -> None:
    """The same per-GPU memory and bucket percentiles from SQLite and PostgreSQL."""
    from tests.dashboard.seed import seed_database

    seed_database(db_url, with_study=False)
    at = open_page(db_url)
    no_exception(at)
    table = _per_instance(at)
    assert table.loc["dcgm-node1", "memory"] == pytest.approx(0.95)
    assert table.loc["vllm-a", "TTFT p99 (s)"] == pytest.approx(TTFT_P99)
    assert sorted(_table(at, "memory peak")["memory"]) == pytest.approx([0.75, 0.95])
