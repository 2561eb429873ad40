"""A storage URL as it may be shown: the password never leaves the process that was given it.

Every place a storage URL is printed, stored (a search's error text in the queue's tables), shown
(``schedule list --json``), logged (a worker's log) or recorded (``autofit run --report``, a
search's JSON) goes through :func:`redact_url`, or :func:`scrub` for free text that may quote it
(an exception's message). The URL is read here, not by SQLAlchemy (which cannot parse a multi-host
URL and hides only the userinfo password): as libpq does, the userinfo ends at the **last** ``@`` of
the authority (a password may hold ``@``, ``:`` or ``/``), and the query parameters libpq treats as
secret (``password``, ``sslpassword``; any name with ``password``, ``secret`` or ``token``) are
hidden too. Hidden values are written ``***``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import quote, quote_plus, unquote, unquote_plus

HIDDEN = "***"
#: query parameters whose values are secret (lower-cased), besides any name holding one of :data:`_SECRET_WORDS`
SECRET_PARAMS = frozenset({"password", "sslpassword", "passfile", "sslkey"})
_SECRET_WORDS = ("password", "secret", "token")


def _split(url: str) -> tuple[str, str | None, str, str, list[tuple[str, str]]] | None:
    """``(scheme, userinfo, hosts and path, fragment, query pairs)``, or None for a string with no ``://``."""
    scheme, sep, rest = str(url).partition("://")
    if not sep:
        return None
    rest, _, fragment = rest.partition("#")
    head, _, query = rest.partition("?")
    userinfo, at, hosts = ("", "", head) if head.startswith("/") else head.rpartition("@")  # sqlite:///a@b.db
    pairs = [(key, value) for key, _, value in (part.partition("=") for part in query.split("&"))] if query else []
    return scheme, (userinfo if at else None), hosts, fragment, pairs


def _secret_param(key: str) -> bool:
    name = unquote(key).lower()
    return name in SECRET_PARAMS or any(word in name for word in _SECRET_WORDS)


def redact_url(url: str) -> str:
    """``url`` with its password and secret query parameters replaced by ``***``."""
    parts = _split(url)
    if parts is None:
        return re.sub(r"(//[^:/@\s]*):\S*@", rf"\1:{HIDDEN}@", str(url))
    scheme, userinfo, hosts, fragment, pairs = parts
    user = ""
    if userinfo is not None:
        name, colon, _ = userinfo.partition(":")
        user = f"{name}:{HIDDEN}@" if colon else f"{name}@"
    query = "&".join(f"{key}={HIDDEN}" if _secret_param(key) else (f"{key}={value}" if value else key)
                     for key, value in pairs)
    return f"{scheme}://{user}{hosts}" + (f"?{query}" if pairs else "") + (f"#{fragment}" if fragment else "")


def secrets(url: str) -> list[str]:
    """The secrets ``url`` holds, as written: its userinfo password and its secret query parameters' values."""
    parts = _split(url)
    if parts is None:
        return []
    _, userinfo, _, _, pairs = parts
    found = [userinfo.partition(":")[2]] if userinfo is not None and ":" in userinfo else []
    # a password holding "@": a driver that splits at the first "@" quotes its tail as the host, so the tails are
    # secrets too (all but very short ones, which would hide common words)
    found += [tail for tail in found[0].split("@")[1:] if len(tail) >= 3] if found else []
    found += [value for key, value in pairs if _secret_param(key)]
    return [secret for secret in found if secret]


def password(url: str) -> str | None:
    """The userinfo password in ``url``, percent-decoded (None without one)."""
    parts = _split(url)
    if parts is None or parts[1] is None or ":" not in parts[1]:
        return None
    return unquote(parts[1].partition(":")[2]) or None


def scrub(text: str, url: str) -> str:
    """``text`` (an error message, a log line) with ``url`` redacted and each of its secrets, as written,
    percent-decoded or URL-quoted, replaced by ``***`` wherever it appears."""
    out = text.replace(url, redact_url(url))
    forms: set[str] = set()
    for secret in secrets(url):
        for plain in {secret, unquote(secret), unquote_plus(secret)}:
            forms |= {plain, quote(plain, safe=""), quote_plus(plain)}
    for form in sorted((f for f in forms if f), key=len, reverse=True):
        out = out.replace(form, HIDDEN)
    return out


#: variables user code and probes never inherit: the queue's URL and libpq's credentials
SECRET_ENV = ("AUTOFIT_STORAGE", "PGPASSWORD", "PGPASSFILE", "PGSSLPASSWORD", "PGSERVICEFILE")


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less :data:`SECRET_ENV` (the environment of a probe, an op build, or user code in a worker)."""
    return {key: value for key, value in environ.items() if key not in SECRET_ENV}


def drop_storage_from_environ() -> None:
    """Remove ``AUTOFIT_STORAGE`` from this process's environment: a worker, once it holds its storage URL, before
    it imports any queued entry. (libpq's ``PG*`` stay: the worker's own reconnects read them; its probes and op
    builds run without them, :func:`without_secrets`.)"""
    os.environ.pop("AUTOFIT_STORAGE", None)
