"""The read model's answer for a completed generation's content (infra.stores.queries._view):
available, pending (the worker reported before its result store took the text and holds it for a later
write) or expired. Pending is bounded by the read model's window and never outlives the result TTL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from infra.stores.queries import ResultPending, ResultState, ResultUnavailable, _view
from infra.stores.results import StoredResult

FINISHED_MS = 1_000_000
TTL_MS = 3_600_000
PENDING_MS = 600_000


def row(status: str = "completed", result_stored: bool | None = None, **kw):
    base = {c: None for c in ("model_alias", "model_version", "tier", "stream", "input_tokens", "output_tokens", "usage_epoch",
                              "finish_reason", "terminal_reason", "code", "partial", "cancel_requested", "window_start_ms",
                              "window_end_ms", "created_at_ms", "accepted_at_ms", "updated_at_ms", "revision", "terminal_sequence")}
    base.update(generation_id="g", user_id="u", status=status, epoch=1, finished_at_ms=FINISHED_MS,
                result_expires_at_ms=FINISHED_MS + TTL_MS, result_stored=result_stored)
    base.update(kw)
    return SimpleNamespace(**base)


def stored(epoch: int = 1) -> StoredResult:
    return StoredResult(generation_id="g", epoch=epoch, text="the answer", input_tokens=3, output_tokens=2,
                        stored_at_ms=FINISHED_MS, expires_at_ms=FINISHED_MS + TTL_MS)


def test_a_stored_result_is_available_whatever_the_report_said():
    for flag in (True, False, None):
        v = _view(row(result_stored=flag), stored(), FINISHED_MS + 1, PENDING_MS)
        assert (v.result, v.require_result()) == (ResultState.AVAILABLE, "the answer")


def test_held_by_the_worker_and_not_stored_yet_is_pending_within_the_window_then_expired():
    v = _view(row(result_stored=False), None, FINISHED_MS + 1, PENDING_MS)
    assert v.result is ResultState.PENDING and v.result_text is None
    with pytest.raises(ResultPending):
        v.require_result()
    late = _view(row(result_stored=False), None, FINISHED_MS + PENDING_MS, PENDING_MS)
    assert late.result is ResultState.EXPIRED
    with pytest.raises(ResultUnavailable):
        late.require_result()


def test_pending_never_outlives_the_result_ttl():
    short = row(result_stored=False, result_expires_at_ms=FINISHED_MS + 10)
    assert _view(short, None, FINISHED_MS + 11, PENDING_MS).result is ResultState.EXPIRED


def test_stored_before_the_report_or_no_store_in_use_is_expired_when_missing():
    # True: the text was in the store before the report, so a missing row is past its TTL (or
    # deleted); None: no store was in use (or a worker from before the field): nothing will come.
    for flag in (True, None):
        assert _view(row(result_stored=flag), None, FINISHED_MS + 1, PENDING_MS).result is ResultState.EXPIRED


def test_a_row_without_the_column_reads_as_unknown():
    old = row()
    del old.result_stored  # a row object from before the column
    assert _view(old, None, FINISHED_MS + 1, PENDING_MS).result is ResultState.EXPIRED


def test_not_completed_has_no_content():
    assert _view(row(status="cancelled", result_stored=False), None, FINISHED_MS + 1, PENDING_MS).result is ResultState.NOT_APPLICABLE
