"""`python -m collector serve`: the collector without the full `kvpilot` CLI (used for child processes)."""

from __future__ import annotations

import logging
import sys

from collector.errors import CollectorError
from collector.server import serve
from collector.settings import CollectorSettings


def main(argv: list[str]) -> int:
    if argv[:1] != ["serve"]:
        print("usage: python -m collector serve   (settings from KVPILOT_* environment variables)", file=sys.stderr)
        return 2
    settings = CollectorSettings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(settings)
    except CollectorError as exc:
        print(f"kvpilot collector: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
