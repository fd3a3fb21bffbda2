"""Capacity by work, not by count: the edge's queue-wait estimate from the work
workers report (edge/capacity.py), and the worker's own measurement of it (workers/work.py)."""

from __future__ import annotations

from typing import Any

from edge.capacity import NO_CAPACITY_WAIT_MS, CapacityView
from schemas.messages import WorkerHeartbeat
from schemas.wire import decode_message, encode
from workers.work import RATE_EWMA_ALPHA, WorkRates, held_work

NOW = 10_000


def hb(worker: str = "w1", **over: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = dict(
        worker_id=worker, pool="p", sent_at_ms=0, free_slots=0, active_sequences=4, queued=0, kv_pressure=1.0,
        tokens_per_s=400.0, prefill_tokens_per_s=10_000.0, decode_tokens_per_s=100.0, output_fill=1.0,
        output_tokens_left=4 * 100, reports_work=True,
    )
    fields.update(over)
    return WorkerHeartbeat(**fields)


def view_of(*heartbeats: WorkerHeartbeat) -> CapacityView:
    view = CapacityView(heartbeat_stale_ms=10_000, generation_service_ms_estimate=4_000)
    for h in heartbeats:
        view.observe(h, received_ms=NOW)
    return view


def wait(view: CapacityView, input_tokens: int = 10, output_budget: int = 100) -> int:
    return view.estimate_wait_ms("p", input_tokens, output_budget, now_ms=NOW)


def test_the_same_counts_with_more_work_left_wait_longer():
    # Four running sequences each, nothing queued: by count these two pools are the same.
    short = view_of(hb(output_tokens_left=4 * 10))
    long = view_of(hb(output_tokens_left=4 * 1_000))
    # A slot frees after about (left per sequence / decode rate) / sequences: 10 tokens at 100/s is
    # 100 ms for one of four, so 25 ms; 1,000 tokens, 2,500 ms.
    assert wait(short) == 25
    assert wait(long) == 2_500


def test_a_long_prompt_queued_ahead_counts_as_more_work_than_a_short_one():
    # Four running and one being prepared (10 tokens still to decode each): a slot frees in
    # (10 / 100 s) / 5 = 20 ms, plus the prompt being prepared at 10,000 tokens/s of prefill.
    short_ahead = view_of(hb(queued=1, queued_input_tokens=50, queued_output_tokens=10, output_tokens_left=4 * 10))
    long_ahead = view_of(hb(queued=1, queued_input_tokens=100_000, queued_output_tokens=10, output_tokens_left=4 * 10))
    assert wait(short_ahead) == 20 + 5
    assert wait(long_ahead) == 20 + 10_000


def test_slots_held_by_work_being_prepared_count_its_whole_expected_output():
    # One slot, taken by a dispatch still being prepared (nothing running yet): a 200-token budget at
    # 10 tokens/s holds it about 20 s, so the next request's wait is far over any queue budget.
    view = view_of(hb(active_sequences=0, queued=1, queued_output_tokens=200, output_tokens_left=0, decode_tokens_per_s=10.0))
    assert wait(view) == 20_000


def test_a_free_slot_is_room_only_for_a_request_that_fits_its_kv_cache():
    view = view_of(hb(free_slots=1, active_sequences=1, output_tokens_left=50, kv_tokens_free=2_000))
    assert wait(view, input_tokens=100, output_budget=100) == 0
    # A hundred-thousand-token prompt does not fit the room left: it waits for a sequence to end.
    assert wait(view, input_tokens=100_000, output_budget=100) == 500  # 50 tokens left at 100/s, one sequence
    # The same worker idle and still too small for it: nothing that ends will make room.
    idle = view_of(hb(free_slots=2, active_sequences=0, output_tokens_left=0, kv_tokens_free=2_000))
    assert wait(idle, input_tokens=100_000) == NO_CAPACITY_WAIT_MS
    assert wait(idle, input_tokens=100) == 0


def test_the_measured_output_fill_scales_the_budget_a_request_needs_in_kv():
    view = view_of(hb(free_slots=1, active_sequences=0, output_tokens_left=0, kv_tokens_free=1_100, output_fill=0.25))
    # 100 prompt tokens + a quarter of a 4,000-token budget fits in 1,100; the whole budget would not.
    assert wait(view, input_tokens=100, output_budget=4_000) == 0
    full = view_of(hb(free_slots=1, active_sequences=0, output_tokens_left=0, kv_tokens_free=1_100, output_fill=1.0))
    assert wait(full, input_tokens=100, output_budget=4_000) == NO_CAPACITY_WAIT_MS


def test_dispatches_waiting_on_the_log_count_ahead_and_their_measured_age_is_a_floor():
    view = view_of(hb(free_slots=1, active_sequences=3, output_tokens_left=30, dispatch_backlog=3, queue_age_ms=900))
    # A free slot does not help a request behind three waiting dispatches: (3 + 1) x (10/100 s) / 3 is
    # 133 ms by the model, but the last dispatch taken had waited 900 ms on the log.
    assert wait(view) == 900
    assert wait(view_of(hb(free_slots=1, active_sequences=3, output_tokens_left=30, dispatch_backlog=3, queue_age_ms=0))) == 133


def test_before_measuring_the_edge_uses_its_estimates_and_older_workers_the_count():
    unmeasured = view_of(hb(decode_tokens_per_s=0.0, prefill_tokens_per_s=0.0, output_tokens_left=4 * 20))
    assert wait(unmeasured) == 250  # 20 tokens at the default 20 tokens/s, one of four sequences
    older = view_of(hb(reports_work=False, queued=3))
    assert wait(older) == 4_000  # (3 + 1) / 4 x generation_service_ms_estimate
    assert view_of().estimate_wait_ms("p", now_ms=NOW) == NO_CAPACITY_WAIT_MS


def test_an_older_heartbeat_without_the_work_fields_still_decodes():
    doc = {k: v for k, v in __import__("orjson").loads(encode(hb())).items() if k not in {
        "prefill_tokens_per_s", "decode_tokens_per_s", "output_fill", "queued_input_tokens", "queued_output_tokens",
        "output_tokens_left", "kv_tokens_free", "dispatch_backlog", "queue_age_ms", "reports_work"}}
    old = decode_message(__import__("orjson").dumps(doc))
    assert isinstance(old, WorkerHeartbeat) and old.reports_work is False and old.kv_tokens_free == -1


def test_the_worker_measures_prefill_decode_and_how_much_of_the_budget_is_used():
    rates = WorkRates()
    # 1,000 prompt tokens prefilled in 0.1 s; 51 tokens, the last 50 decoded in 0.5 s; 51 of 100 used.
    rates.observe(1_000, 100, 51, started_at=0.0, first_token_at=0.1, ended_at=0.6, ran_to_its_end=True)
    assert round(rates.prefill_tokens_per_s) == 10_000 and round(rates.decode_tokens_per_s) == 100
    assert rates.output_fill == 1.0 + RATE_EWMA_ALPHA * (0.51 - 1.0)
    # A cancelled one says nothing about the budget used; its rates still count.
    before = rates.output_fill
    rates.observe(1_000, 100, 3, started_at=0.0, first_token_at=0.2, ended_at=0.22, ran_to_its_end=False)
    assert rates.output_fill == before
    assert rates.prefill_tokens_per_s == 10_000 + RATE_EWMA_ALPHA * (5_000 - 10_000)


def test_held_work_splits_queued_from_running_and_counts_what_the_kv_cache_may_hold():
    rates = WorkRates(output_fill=0.5)
    work = held_work(rates, [(False, 300, 100, 0), (True, 200, 100, 10), (True, 100, 100, 80)])
    assert (work.queued_input_tokens, work.queued_output_tokens) == (300, 50)
    assert work.output_tokens_left == 40 + 1  # 50 - 10, and one that ran past its expected output
    assert work.tokens_held == (300 + 50) + (200 + 50) + (100 + 80)
