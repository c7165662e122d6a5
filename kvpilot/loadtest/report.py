"""The final table (stderr) and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value * 1000:.1f} ms" if unit == "s" else f"{value:.4g}{unit}"
    return f"{value}{unit}"


def _header(report: dict) -> str:
    """The scenario and the arrival rate the plan was made with (a trace's own, a share of capacity)."""
    basis = f" ({report['rate_basis']})" if report.get("rate_basis") else ""
    return f"{report.get('scenario')} @ {report.get('rate_per_s')} req/s{basis}, {report.get('duration_s')} s"


def render_table(report: dict) -> str:
    rows: list[tuple[str, str]] = [
        ("scenario", _header(report)),
        (
            "requests",
            f"sent {report['requests_sent']}, answered {report['requests_answered']}, "
            f"429 {report['requests_refused']}, failed {report['requests_failed']}, "
            f"timed out {report['requests_timed_out']}",
        ),
        (
            "throughput",
            f"{_fmt(report['throughput']['requests_per_s'])} req/s, "
            f"{_fmt(report['throughput']['output_tokens_per_s'])} tok/s",
        ),
    ]
    if "tokens" in report:
        tok = report["tokens"]
        rows.append(
            (
                "tokens planned/served",
                f"prompt {tok['prompt_planned']}/{_fmt(tok['prompt_served'])}, output {tok['output_planned']}/"
                f"{tok['output_served']} (output counted by {tok['output_counted_by']}; "
                f"prompts as {tok['prompt_form']})",
            )
        )
    if "client_lateness" in report:
        late = report["client_lateness"]
        rows.append(("client late p50/p99/max", " / ".join(_fmt(late[k], "s") for k in ("p50_s", "p99_s", "max_s"))))
    for name, stats in report["latency_s"].items():
        rows.append((f"{name} p50/p90/p99", " / ".join(_fmt(stats[k], "s") for k in ("p50", "p90", "p99"))))
    rows.append(("windows p99", ", ".join(_fmt(w["p99_s"], "s") for w in report["windows"])))
    rows.append(("windows util", ", ".join(_fmt(w["utilization"]) for w in report["windows"])))
    for name, crit in report["criteria"].items():
        mark = "PASS" if crit["passed"] else "FAIL"
        rows.append((f"[{mark}] {name}", f"{_fmt(crit['value'])} (limit {crit['threshold']}) {crit['detail']}"))
    if "cold_start" in report:
        cs = report["cold_start"]
        rows.append(
            (
                "cold start p99 e2e",
                f"{_fmt(cs['without_warmup']['e2e_s']['p99'], 's')} without vs "
                f"{_fmt(cs['with_warmup']['e2e_s']['p99'], 's')} with warm-up "
                f"(first {cs['requests']})",
            )
        )
    if "published" in report:
        p = report["published"]
        rows.append(("collector", f"{p['acknowledged']}/{p['events']} events acknowledged, run {p['run_id']}"))
    if "fault" in report:
        f = report["fault"]
        for name, check in f["checks"].items():
            mark = "PASS" if check["passed"] else "FAIL"
            rows.append((f"[{mark}] fault {name}", str(check["detail"])))
    if report.get("figures_count") is False:
        rows.append(("FIGURES DO NOT COUNT", report["criteria"]["client_on_time"]["detail"]))
    rows.append(("RESULT", "PASS" if report["passed"] else "FAIL"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
