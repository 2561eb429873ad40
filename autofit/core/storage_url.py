"""A storage URL as it may be shown: the password never leaves the process that was given it.

Every place a storage URL is printed, stored (a search's error text in the queue's tables), shown
(``schedule list --json``), logged (a worker's log) or recorded (``autofit run --report``, a
search's JSON) goes through :func:`redact_url`, or :func:`scrub` for free text that may quote it
(an exception's message). The rendering is SQLAlchemy's own,
``URL.render_as_string(hide_password=True)`` (sqlalchemy/engine/url.py), which writes ``***``.
"""

from __future__ import annotations

import re
from urllib.parse import quote, quote_plus

HIDDEN = "***"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (a string SQLAlchemy cannot parse: any ``:secret@`` hidden)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError, TypeError):
        return re.sub(r"(//[^:/@\s]*):[^@\s]*@", rf"\1:{HIDDEN}@", str(url))


def password(url: str) -> str | None:
    """The password in ``url`` (None without one, or when it does not parse)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        secret = make_url(url).password
    except (ArgumentError, ValueError, TypeError):
        return None
    return str(secret) if secret else None


def scrub(text: str, url: str) -> str:
    """``text`` (an error message, a log line) with ``url`` redacted and its password, as written, URL-quoted
    or not, replaced by ``***`` wherever it appears."""
    out = text.replace(url, redact_url(url))
    secret = password(url)
    if secret:
        for form in {secret, quote(secret, safe=""), quote_plus(secret)}:
            out = out.replace(form, HIDDEN)
    return out
