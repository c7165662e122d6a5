"""The bearer token a sink sends: a fixed value, or a file re-read whenever it changes.

A file lets an engine follow a rotation of its collector identity without a restart (`kvpilot collector
tokens rotate` prints the new secret; whoever deploys it writes it to the file, atomically, e.g. a
mounted Kubernetes secret): the next batch goes with the new secret, and the old one can be revoked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class TokenSource:
    def __init__(self, token: str | None = None, path: str | os.PathLike | None = None) -> None:
        if token and path:
            raise ValueError("give the collector token or a token file, not both")
        self.path = Path(path) if path else None
        self._value = token or None
        self._stamp: tuple[int, ...] | None = None
        if self.path is not None:
            self.current()
            if self._value is None:
                raise ValueError(f"token file {self.path}: missing, unreadable or empty")

    def current(self) -> str | None:
        """The token now (one stat per call; the file is read only when it changed)."""
        if self.path is None:
            return self._value
        try:
            st = os.stat(self.path)
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if stamp != self._stamp:
                value = self.path.read_text(encoding="utf-8").strip()
                if value:
                    if self._value is not None and value != self._value:
                        log.info("telemetry: the collector token in %s changed; sending with the new one", self.path)
                    self._value = value
                self._stamp = stamp
        except OSError as exc:
            if self._stamp is not None:
                log.warning("telemetry: cannot read the token file %s (%s); keeping the last token", self.path, exc)
                self._stamp = None
        return self._value
