"""The suite's guard against a test straddling a quota window boundary (tests/conftest.py)."""

from __future__ import annotations

import datetime as dt

from tests.conftest import seconds_to_next_window


def at(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


def test_seconds_to_the_next_fixed_utc_window():
    assert seconds_to_next_window(at("2026-12-06T20:59:00")) == 60.0
    assert seconds_to_next_window(at("2026-12-06T21:00:00")) == 3 * 3600.0
    assert seconds_to_next_window(at("2026-12-06T23:30:00.500")) == 1799.5
