"""One scraped body as it arrives: inflated here a step at a time, bounded in size and time, one coding at most.

httpx inflates a whole network chunk at once, whatever it becomes, and honours stacked codings
(`Content-Encoding: gzip, gzip`): 1,830 bytes once became 2.2 GB every interval, and a 6.7 KB response of
4 GiB never finished. So the scraper reads the raw bytes and inflates them here with a running cap.
"""

from __future__ import annotations

import time
import zlib

from collector.errors import CollectorError

MAX_SCRAPE_BYTES = 16 * 2**20
BOUNDS = ("size", "coding", "samples", "deadline")


class ScrapeError(CollectorError):
    """A scrape that failed on our side of the wire: status, size, coding, sample count or deadline. Its
    text is stored as the target's `last_error`: it names the bound, never what the target sent. `bound`:
    which of BOUNDS stopped it, counted in `kvpilot_collector_scrape_bound_failures_total{bound}`."""

    def __init__(self, message: str, *, bound: str | None = None) -> None:
        super().__init__(message)
        self.bound = bound


_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
INFLATE_STEP = 1 << 20  # bytes inflated between two checks of the size cap and the deadline


class BoundedBody:
    """A scraped body as it arrives: inflated a step at a time, at most MAX_SCRAPE_BYTES, before `give_up`."""

    def __init__(self, codings: list[str], give_up: float, deadline_s: float) -> None:
        codings = [c.strip().lower() for c in codings if c.strip().lower() not in ("", "identity")]
        if len(codings) > 1:
            raise ScrapeError("more than one content coding", bound="coding")
        if codings and codings[0] not in _CODINGS:
            raise ScrapeError("unsupported content coding", bound="coding")
        self.inflater = zlib.decompressobj(_CODINGS[codings[0]]) if codings else None
        self.give_up = give_up
        self.deadline_s = deadline_s
        self.parts: list[bytes] = []
        self.size = 0

    def _keep(self, part: bytes) -> None:
        if time.monotonic() > self.give_up:
            raise ScrapeError(f"deadline of {self.deadline_s:g}s exceeded", bound="deadline")
        self.size += len(part)
        if self.size > MAX_SCRAPE_BYTES:
            raise ScrapeError(f"response larger than {MAX_SCRAPE_BYTES} bytes", bound="size")
        self.parts.append(part)

    def feed(self, chunk: bytes) -> None:
        if self.inflater is None:
            self._keep(chunk)
            return
        pending = chunk
        try:
            while pending and not self.inflater.eof:
                self._keep(self.inflater.decompress(pending, INFLATE_STEP))
                pending = self.inflater.unconsumed_tail
        except zlib.error:
            raise ScrapeError("invalid compressed body") from None
        self._keep(b"")  # the deadline, also for a chunk that inflated to nothing

    def text(self) -> str:
        if self.inflater is not None and not self.inflater.eof:
            raise ScrapeError("truncated compressed body")
        return b"".join(self.parts).decode("utf-8", errors="replace")
