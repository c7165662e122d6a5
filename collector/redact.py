"""Credentials out of URLs before they are shown or logged: one helper for every response and log line.

A scrape target's URL may carry credentials (`http://user:pass@host/metrics?token=...`); only the
scraper needs them, so the database keeps the URL whole and everything else shows `redact_url(url)`:
the userinfo and the values of secret-looking query parameters become `***`. `redact_text` does the
same to every URL inside a message (an exception's text), and `RedactingFilter` to every record of a
logger it is attached to (httpx logs each request's URL at INFO).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"
# Substrings of a query parameter's name that say its value is a credential.
SECRET_WORDS = (
    "token",
    "key",
    "secret",
    "pass",
    "pwd",
    "auth",
    "sig",
    "credential",
    "session",
    "cookie",
    "jwt",
    "bearer",
    "private",
    "access",
)
_URL = re.compile(r"""\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'"<>`]+""")


def _secret_name(name: str) -> bool:
    lowered = unquote(name).lower()
    return any(word in lowered for word in SECRET_WORDS)


def _masked_pairs(text: str) -> str:
    if "=" not in text:
        return text
    pairs = []
    for pair in text.split("&"):
        name, eq, value = pair.partition("=")
        pairs.append(f"{name}={MASK}" if eq and value and _secret_name(name) else pair)
    return "&".join(pairs)


def redact_url(url: str) -> str:
    """`url` with its userinfo and secret-looking query values masked; unchanged (byte for byte) when it
    has none, so a caller may still compare the URLs it registered."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # not parseable: show nothing of it rather than something
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rpartition("@")[2]
    query, fragment = _masked_pairs(parts.query), _masked_pairs(parts.fragment)  # `#access_token=` too
    if netloc == parts.netloc and query == parts.query and fragment == parts.fragment:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str) -> str:
    """Every URL inside `text` redacted."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


class RedactingFilter(logging.Filter):
    """Redacts the URLs of every record of the logger it is attached to (and keeps the record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def redact_logger(name: str) -> None:
    """Attach one RedactingFilter to logger `name` (idempotent)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
