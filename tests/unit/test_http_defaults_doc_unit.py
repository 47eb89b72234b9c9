"""The HTTP front end's documented defaults are its defaults. docs/reference.md's "Limits"
and "App settings" sections and docs/security.md's "The HTTP queue is bounded" write them
as `` `name` (value) `` (or `` `name`, value ``); each is read off the page here and
compared with the settings a default app is built from (``AppSettings.from_args``), and
the queue's with the options of the Serve deployment ``build_app`` makes of them. A
default changed in the code or on the page, and not in both, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deploy import serve_app
from deploy.settings import AppSettings, Limits

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"
# a value as the pages write it: true / false, 200,000 / 512 / 1.5, then maybe a unit
_VALUE = r"(true|false|-?\d{1,3}(?:,\d{3})+|-?\d+(?:\.\d+)?)(?: ?(?:s|ms))?(?=[\s:,;)])"
_DOCUMENTED = re.compile(r"`(\w+)`(?: \(|, )" + _VALUE)
# what each page must still document (so that a reworded page cannot pass by saying nothing)
QUEUE = {"max_ongoing_requests", "max_queued_requests", "backpressure_retry_after_s",
         "body_timeout_s"}
REFERENCE_AT_LEAST = {"max_queued_requests", "backpressure_retry_after_s", "body_timeout_s",
                      "scheduler_timeout_s", "stream_events_per_s", "stream_interval_ms",
                      "max_json_depth", "max_n", "max_choices", "max_prompt_chars",
                      "default_max_tokens", "max_session_id_chars"}


def _section(text: str, start: str, stop: str) -> str:
    """From the first line starting with ``start`` to the next starting with ``stop``,
    lines joined (a name and its value may be wrapped apart)."""
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith(start))
    last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith(stop)),
                len(lines))
    return " ".join(" ".join(lines[first:last]).split())


def _documented(section: str) -> dict[str, object]:
    """{setting: documented default} for every backticked app setting or limit with a value
    beside it (other backticked names, e.g. the runtime's, are left out)."""
    fields = set(AppSettings.model_fields) | set(Limits.model_fields)
    found: dict[str, object] = {}
    for name, raw in _DOCUMENTED.findall(section):
        if name not in fields:
            continue
        value = {"true": True, "false": False}.get(raw)
        if value is None:
            value = float(raw.replace(",", ""))
        assert found.setdefault(name, value) == value, f"{name} documented twice, apart"
    return found


def _reference() -> dict[str, object]:
    text = (DOCS / "reference.md").read_text()
    limits = _section(text, "### Limits", "### ")
    app = _section(text, "### App settings", "### ")
    return {**_documented(limits), **_documented(app)}


def _security_queue() -> dict[str, object]:
    text = (DOCS / "security.md").read_text()
    return _documented(_section(text, "- **The HTTP queue is bounded", "- **"))


@pytest.fixture
def defaults(monkeypatch) -> AppSettings:
    for name in ("RAYGUIDE_API_KEY", "RAYGUIDE_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    return AppSettings.from_args(None)


def _actual(settings: AppSettings, name: str):
    return getattr(settings.limits if name in Limits.model_fields else settings, name)


@pytest.mark.parametrize("page", ["reference", "security"])
def test_documented_defaults_are_the_defaults(page, defaults):
    documented = _reference() if page == "reference" else _security_queue()
    missing = (REFERENCE_AT_LEAST if page == "reference" else QUEUE) - set(documented)
    assert not missing, f"docs/{page}.md no longer gives a default for {sorted(missing)}"
    wrong = {name: (value, _actual(defaults, name)) for name, value in documented.items()
             if _actual(defaults, name) != value}
    assert not wrong, f"docs/{page}.md's defaults that are not the code's " \
                      f"(name: (documented, actual)): {wrong}"


def test_the_default_app_queues_as_documented(defaults):
    """The documented queue is what Serve gets: the deployment of a default app."""
    documented = {**_reference(), **_security_queue()}
    config = serve_app._application(defaults)._bound_deployment._deployment_config
    assert config.max_ongoing_requests == documented["max_ongoing_requests"]
    assert config.max_queued_requests == documented["max_queued_requests"]
    assert config.backpressure_config.retry_after_s == documented["backpressure_retry_after_s"]
    assert config.backpressure_config.status_code == 429  # docs/security.md: "answered 429"
