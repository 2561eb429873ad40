"""Issue 40, class 5: a storage URL's secrets in every form stay hidden (the real CLI), and a probe's environment
never carries the queue's URL or libpq's password."""

from __future__ import annotations

import pytest
from hostile_helpers import autofit

from autofit.core.storage_url import redact_url, scrub
from autofit.probe.launch import training_env

SECRET = "S3cretPw9"
DOWN = "127.0.0.1:9"  # nothing listens

FORMS = [
    f"postgresql://u@h/db?password={SECRET}",
    f"postgresql://u:x@{SECRET}@h/db",
    f"postgresql://u:{SECRET}@h1:5432,h2:5432/db",
    f"postgresql://u:x%40{SECRET}@h/db",
    f"postgresql+psycopg2://u@h/db?sslpassword={SECRET}",
    f"postgresql://u@h/db?PASSWORD={SECRET}",
    f"postgresql://u:a:b/{SECRET}@h/db",
]


@pytest.mark.parametrize("url", FORMS)
def test_every_url_form_hides_its_secret(url: str) -> None:
    text = f"could not connect to {url} ({url.split('://', 1)[1]})"
    assert SECRET not in redact_url(url) and SECRET not in scrub(text, url)
    assert redact_url(url).startswith(url.split("://")[0])


def test_urls_without_secrets_are_unchanged() -> None:
    for url in ("sqlite:///tmp/a@b.db", "sqlite:///autofit.db", "postgresql://u@h:5432/db?sslmode=require"):
        assert redact_url(url) == url


def test_a_probe_environment_drops_the_queue_url_and_libpq_password() -> None:
    env = training_env({"AUTOFIT_STORAGE": "postgresql://u:pw@h/db", "PGPASSWORD": "pw", "PATH": "/bin"}, "cpu", 1, 1)
    assert "AUTOFIT_STORAGE" not in env and "PGPASSWORD" not in env and env["PATH"] == "/bin"


@pytest.mark.slow
@pytest.mark.parametrize("query", [f"?password={SECRET}", f"?sslpassword={SECRET}"])
def test_schedule_list_never_prints_a_query_password(query: str) -> None:
    res = autofit("schedule", "list", "--storage", f"postgresql://alice@{DOWN}/db{query}", timeout=90)
    assert res.returncode != 0
    assert SECRET not in res.stdout + res.stderr, res.stderr[-300:]


@pytest.mark.slow
def test_schedule_list_never_prints_a_password_holding_an_at() -> None:
    res = autofit("schedule", "list", "--storage", f"postgresql://alice:p@{SECRET}@{DOWN}/db", timeout=90)
    assert SECRET not in res.stdout + res.stderr, res.stderr[-300:]
