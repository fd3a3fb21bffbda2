"""Given-events / when-command / then-events: keyless retries attach to their first try's generation.

A submit without the client's own ``Idempotency-Key`` (the OpenAI-compatible route) carries a key the
edge made up, so its tries are told apart only by ``RetryAttach`` and matched by fingerprint, in the
admission decision itself (``decide._attach_to_earlier_try``). Every story runs through
``tests.unit.ledger_dsl.Ledger``, which checks every invariant after every command.
"""

from __future__ import annotations

from dataclasses import replace

import orjson

from control_plane.aggregate import Aggregate, handle
from control_plane.codec import dump_aggregate, load_aggregate
from control_plane.evolve import evolve_all
from control_plane.invariants import check_state
from control_plane.policy import Policy
from control_plane.state import RETRY_FINGERPRINTS_PER_USER_MAX, UserLedger
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus, RetryAttach
from schemas.messages import OutcomeKind
from tests.unit.ledger_dsl import Ledger, types

EDGE_A, EDGE_B = "edge-a", "edge-b"
FP = "fp-openai-1"
WINDOW_MS = Policy().openai_retry_attach_ms


def first_try(L: Ledger, n: int = 1, fingerprint: str = FP, reader: str = EDGE_A, **over):
    return L.submit(f"oai-first-{n}", fingerprint, retry_attach=RetryAttach.ORIGINAL, reader_id=reader, **over)


def retry(L: Ledger, n: int = 1, fingerprint: str = FP, reader: str = EDGE_A, **over):
    return L.submit(f"oai-retry-{n}", fingerprint, retry_attach=RetryAttach.RETRY, reader_id=reader, **over)


def admitted(d) -> str:
    assert d.outcome.kind is OutcomeKind.ADMITTED, d.outcome
    return d.outcome.generation_id


def assert_attached(d, generation_id: str, status: RequestStatus) -> None:
    assert d.outcome.kind is OutcomeKind.APPLIED and d.outcome.attached, d.outcome
    assert d.outcome.generation_id == generation_id and d.outcome.status is status and d.outcome.epoch == 1


def test_a_retry_of_a_running_first_try_attaches_and_reserves_nothing():
    L = Ledger()
    g = admitted(first_try(L))
    assert L.state.retry_fingerprints[FP].generation_id == g
    assert L.state.retry_fingerprints[FP].attach_until_ms == L.now_ms + WINDOW_MS
    L.accept(g)
    L.advance(900)  # the client's timeout and backoff
    d = retry(L)
    assert types(d) == ["RequestAttached"], "the same reader on the same edge: nothing to withdraw"
    assert d.events[0].retry_attach is RetryAttach.RETRY and d.events[0].idempotency_key == "oai-retry-1"
    assert_attached(d, g, RequestStatus.RUNNING)
    assert L.window().used == 1 and L.window().reserved == 0, "one message spent for both tries"
    assert "oai-retry-1" not in L.state.requests, "an attached try stores no request record"
    assert list(L.state.slots.values()) == [g]


def test_a_retry_racing_its_first_tries_admission_attaches_to_the_queued_generation():
    # The retry was sent before the first try's decision; both ride the user's partition, so the
    # processor decides the first try first and the retry finds it queued.
    L = Ledger()
    g = admitted(first_try(L))
    d = retry(L)
    assert_attached(d, g, RequestStatus.QUEUED)
    L.accept(g)
    L.report(g)
    assert L.window().used == 1 and L.window().reserved == 0 and L.window().released == 0


def test_a_first_try_read_after_its_retry_attaches_to_the_retrys_generation_once():
    # The edge appended the retry before its first try: the retry matched nothing and was admitted;
    # the first try then attaches to it, and a later identical first try is a request of its own.
    L = Ledger()
    g = admitted(retry(L))
    assert L.state.retry_fingerprints[FP].awaiting_original
    d = first_try(L)
    assert types(d) == ["RequestAttached"] and d.events[0].retry_attach is RetryAttach.ORIGINAL
    assert_attached(d, g, RequestStatus.QUEUED)
    assert not L.state.retry_fingerprints[FP].awaiting_original
    assert L.record(g).reader_id == EDGE_A
    again = admitted(first_try(L, n=2))
    assert again != g and L.window().reserved == 2


def test_two_identical_calls_that_are_not_retries_are_two_generations():
    L = Ledger()
    g1 = admitted(first_try(L, n=1))
    L.accept(g1)
    L.report(g1)
    g2 = admitted(first_try(L, n=2))
    assert g2 != g1 and L.window().used == 1 and L.window().reserved == 1
    assert L.state.retry_fingerprints[FP].generation_id == g2, "the newest generation is remembered"
    assert_attached(retry(L), g2, RequestStatus.QUEUED)


def test_a_retry_of_a_completed_first_try_gets_its_retained_result():
    L = Ledger()
    g = admitted(first_try(L))
    L.accept(g)
    L.report(g)
    d = retry(L)
    assert_attached(d, g, RequestStatus.COMPLETED)
    assert d.outcome.result_expires_at_ms == L.record(g).result_expires_at_ms
    assert L.window().used == 1


def test_a_retry_after_the_window_or_of_a_cancelled_or_failed_generation_is_a_new_request():
    L = Ledger()
    g = admitted(first_try(L))
    L.accept(g)
    L.report(g)
    L.advance(WINDOW_MS)
    late = admitted(retry(L, n=1))
    assert late != g, "the window has ended"
    L.cancel(late)

    cancelled = admitted(first_try(L, n=2, fingerprint="fp-cancelled"))
    L.cancel(cancelled)
    assert L.record(cancelled).status is RequestStatus.CANCELLED
    fresh = admitted(retry(L, n=2, fingerprint="fp-cancelled"))
    assert fresh != cancelled
    L.cancel(fresh)

    failed = admitted(first_try(L, n=3, fingerprint="fp-failed"))
    L.accept(failed)
    L.report(failed, FinishOutcome.FAILED, error_code=RejectionCode.MODEL_BACKEND_ERROR)
    assert L.record(failed).status is RequestStatus.FAILED
    assert admitted(retry(L, n=3, fingerprint="fp-failed")) != failed


def test_a_generation_being_cancelled_does_not_match():
    L = Ledger()
    g = admitted(first_try(L))
    L.accept(g)
    assert types(L.cancel(g)) == ["CancelRequested"]
    other = admitted(retry(L))
    assert other != g


def test_a_retry_withdraws_the_pending_disconnect_cancel_as_a_reattaching_reader_does():
    L = Ledger()
    g = admitted(first_try(L))
    L.accept(g)
    L.detach(g, EDGE_A, grace_ms=5_000)  # the first try's client gave up
    L.advance(1_000)
    d = retry(L)
    assert types(d) == ["RequestAttached", "ReaderAttached"] and d.events[1].reader_id == EDGE_A
    assert L.record(g).detached_until_ms == 0
    L.advance(4_500)  # past the detach deadline, within the lease
    assert types(L.reconcile()) == [], "no cancel after the grace: a reader is back"
    assert L.record(g).status is RequestStatus.RUNNING


def test_a_retry_on_another_edge_takes_the_reader_so_the_first_edges_late_detach_is_ignored():
    L = Ledger()
    g = admitted(first_try(L, reader=EDGE_A))
    L.accept(g)
    d = retry(L, reader=EDGE_B)
    assert types(d) == ["RequestAttached", "ReaderAttached"] and L.record(g).reader_id == EDGE_B
    assert types(L.detach(g, EDGE_A)) == [], "the first edge's reader is no longer the generation's"
    assert L.record(g).detached_until_ms == 0


def test_a_first_try_read_late_does_not_take_the_reader_from_its_retry():
    L = Ledger()
    g = admitted(retry(L, reader=EDGE_B))
    d = first_try(L, reader=EDGE_A)
    assert types(d) == ["RequestAttached"] and L.record(g).reader_id == EDGE_B


def test_a_request_with_its_own_key_never_attaches_and_is_never_remembered():
    L = Ledger()
    g1 = admitted(L.submit("client-key-1", FP))
    g2 = admitted(L.submit("client-key-2", FP))
    assert g1 != g2 and L.state.retry_fingerprints == {}
    L.cancel(g1)
    assert admitted(retry(L)) not in (g1, g2), "a keyless retry matches only keyless tries"


def test_a_retry_read_past_its_decision_deadline_is_refused_not_attached():
    L = Ledger()
    g = admitted(first_try(L))
    d = retry(L, decide_by_ms=L.now_ms + 100, read_at_ms=L.now_ms + 200)
    assert d.outcome.code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE and types(d) == ["AdmissionRejected"]
    assert L.record(g).reader_id == EDGE_A and L.window().reserved == 1


def test_a_zero_window_turns_the_matching_off():
    L = Ledger(policy=Policy(openai_retry_attach_ms=0))
    g = admitted(first_try(L))
    assert L.state.retry_fingerprints == {}
    assert admitted(retry(L)) != g


def test_remembered_fingerprints_are_bounded_and_leave_when_their_window_ends():
    L = Ledger(policy=Policy(concurrency_limit=1, quota_limit_by_tier=dict.fromkeys(Policy().quota_limit_by_tier, 1_000)))
    for n in range(RETRY_FINGERPRINTS_PER_USER_MAX + 8):
        g = admitted(first_try(L, n=n, fingerprint=f"fp-{n:04d}"))
        L.accept(g)
        L.report(g)
        L.advance(10)
        assert len(L.state.retry_fingerprints) <= RETRY_FINGERPRINTS_PER_USER_MAX
        assert not check_state(L.state)
    assert len(L.state.retry_fingerprints) == RETRY_FINGERPRINTS_PER_USER_MAX
    assert "fp-0000" not in L.state.retry_fingerprints, "the entry whose window ends first left"
    L.advance(WINDOW_MS)
    admitted(first_try(L, n=999, fingerprint="fp-fresh"))
    assert list(L.state.retry_fingerprints) == ["fp-fresh"], "entries past their window left"


def test_replay_and_the_table_value_keep_the_remembered_fingerprints():
    L = Ledger()
    admitted(retry(L))
    g = admitted(first_try(L, n=2, fingerprint="fp-other"))
    replayed = evolve_all(UserLedger(L.user_id), L.all_events)
    assert replayed == L.state
    reloaded = load_aggregate(dump_aggregate(L.aggregate)).ledger
    assert reloaded.retry_fingerprints == L.state.retry_fingerprints
    assert reloaded.retry_fingerprints["fp-other"].generation_id == g


def test_a_stored_value_from_before_the_map_loads_with_nothing_remembered():
    L = Ledger()
    admitted(first_try(L))
    doc = orjson.loads(dump_aggregate(L.aggregate))
    del doc["ledger"]["retry_fingerprints"]
    reloaded = load_aggregate(orjson.dumps(doc)).ledger
    assert reloaded.retry_fingerprints == {} and reloaded.requests == L.state.requests


def test_a_redelivered_retry_decides_the_same_way():
    L = Ledger()
    g = admitted(first_try(L))
    command = L.submit_cmd("oai-retry-x", FP, retry_attach=RetryAttach.RETRY, reader_id=EDGE_B)
    aggregate, first, _ = handle(L.aggregate, command, L.policy)
    again, second, _ = handle(aggregate, command, L.policy)
    assert first == second and again.ledger == aggregate.ledger
    fresh, third, _ = handle(replace(Aggregate.empty(L.user_id), ledger=L.state), command, L.policy)
    assert third.events == first.events and fresh.ledger.record_of(g).reader_id == EDGE_B
    assert first.outcome.attached and first.outcome.generation_id == g
