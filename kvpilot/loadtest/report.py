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


def render_table(report: dict) -> str:
    rows: list[tuple[str, str]] = [
        ("scenario", f"{report.get('scenario')} @ {report.get('rate_per_s')} req/s, {report.get('duration_s')} s"),
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
    rows.append(("RESULT", "PASS" if report["passed"] else "FAIL"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
