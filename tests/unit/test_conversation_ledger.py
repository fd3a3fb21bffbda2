"""The conversation rules of the per-user ledger (docs/conversations.md), on the pure core.

Each test drives ``handle`` through ``tests.unit.ledger_dsl.Ledger``, whose invariant monitor also
checks invariant 10 (contiguous revisions, one commit per turn and per answer, one generation in
flight, nothing appended to a deleted conversation) after every command.
"""

from __future__ import annotations

from dataclasses import replace

from control_plane.decide import next_deadline_ms
from control_plane.ids import conversation_id_for
from control_plane.invariants import InvariantMonitor
from control_plane.policy import Policy
from control_plane.routing import route
from schemas import events as ev
from schemas import topics
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus
from schemas.messages import DispatchAuthorized, GenerationFinalized, OutcomeKind
from schemas.wire import decode_message
from tests.unit.ledger_dsl import Ledger, types

HOUR = 3600 * 1000


def _turn(L: Ledger, key: str, revision: int, **over) -> str:
    d = L.turn(key, revision, **over)
    assert d.outcome.kind is OutcomeKind.ADMITTED, d.outcome
    return d.outcome.generation_id


def _answered(L: Ledger, key: str, revision: int, **over) -> str:
    """A user turn at ``revision`` answered in full: run, spooled, reported, stored."""
    g = _turn(L, key, revision, **over)
    L.accept(g)
    L.report(g, answer_spooled=True)
    d = L.commit_answer(g)
    assert "ConversationAnswerCommitted" in types(d)
    return g


def test_create_is_idempotent_and_a_conversation_id_is_derived_from_user_and_key():
    L = Ledger()
    d = L.create_conversation()
    assert types(d) == ["ConversationCreated"] and d.outcome.kind is OutcomeKind.APPLIED and d.outcome.revision == 0
    again = L.create_conversation()
    assert again.events == () and again.outcome.kind is OutcomeKind.EXISTING
    assert conversation_id_for("u1", "k") == conversation_id_for("u1", "k") != conversation_id_for("u2", "k")


def test_a_turn_commits_the_user_message_with_the_admission_in_one_decision():
    L = Ledger()
    L.create_conversation()
    d = L.turn("t1", 0)
    assert types(d) == ["GenerationAdmitted", "ConversationTurnCommitted"]
    assert d.events[1].revision == 1 and d.outcome.revision == 1 and d.outcome.conversation_id == "conv_a"
    assert L.state.conversations["conv_a"].in_flight == d.outcome.generation_id
    assert L.record(d.outcome.generation_id).conversation_id == "conv_a"


def test_twenty_racing_turns_against_one_revision_admit_exactly_one_and_charge_once():
    L = Ledger()
    L.create_conversation()
    outcomes = [L.turn(f"race-{i}", 0).outcome for i in range(20)]
    admitted = [o for o in outcomes if o.kind is OutcomeKind.ADMITTED]
    assert len(admitted) == 1
    # The winner's user message moved the revision: every other one is a stale-revision conflict.
    assert all(o.code is RejectionCode.CONVERSATION_CONFLICT and o.details.revision == 1 for o in outcomes[1:])
    g = admitted[0].generation_id
    # A turn sent at the new revision while the answer runs is told which generation runs.
    busy = L.turn("busy", 1).outcome
    assert busy.code is RejectionCode.GENERATION_IN_PROGRESS and busy.generation_id == g
    L.accept(g)
    L.report(g, answer_spooled=True)
    L.commit_answer(g)
    late = L.turn("late", 0).outcome
    assert late.code is RejectionCode.CONVERSATION_CONFLICT and late.details.revision == 2
    assert L.window().used == 1 and L.window().reserved == 0
    assert len([e for e in L.all_events if isinstance(e, ev.ConversationTurnCommitted)]) == 1


def test_the_answer_commits_only_after_the_writer_stored_it_in_either_order():
    L = Ledger()
    L.create_conversation()
    g = _turn(L, "t1", 0)
    L.accept(g)
    d = L.report(g, answer_spooled=True)
    assert "GenerationCompleted" in types(d) and types(d)[-1] == "ConversationAnswerPending"
    assert L.state.conversations["conv_a"].revision == 1
    d = L.commit_answer(g)
    assert types(d) == ["ConversationAnswerCommitted"]
    assert (d.events[0].revision, d.events[0].status, d.events[0].spooled) == (2, "completed", True)
    assert L.state.conversations["conv_a"].in_flight == ""
    assert L.commit_answer(g).events == ()  # a repeated commit changes nothing
    # The writer first, then the worker's report: the report commits it.
    g2 = _turn(L, "t2", 2)
    L.accept(g2)
    assert types(L.commit_answer(g2)) == ["ConversationAnswerStored"]
    d = L.report(g2, answer_spooled=True)
    assert types(d)[-1] == "ConversationAnswerCommitted" and d.events[-1].revision == 4


def test_the_end_of_a_turn_is_announced_to_the_edge_only_with_its_answer_commit():
    L = Ledger()
    L.create_conversation()
    topo = topics.Topology("t")
    before = L.state
    d = L.turn("t1", 0)
    dispatch = [decode_message(o.value) for o in route(topo, before, L.state, L.submit_cmd("x"), d, 0) if "dispatch" in o.topic]
    assert isinstance(dispatch[0], DispatchAuthorized) and dispatch[0].conversation_id == "conv_a"
    g = d.outcome.generation_id
    L.accept(g)
    before = L.state
    report = L.report(g, answer_spooled=True)
    sent = [decode_message(o.value) for o in route(topo, before, L.state, L.submit_cmd("x"), report, 0) if o.topic == "chatplane.edge-inbox"]
    assert not any(isinstance(m, GenerationFinalized) for m in sent)
    before = L.state
    commit = L.commit_answer(g)
    sent = [decode_message(o.value) for o in route(topo, before, L.state, L.submit_cmd("x"), commit, 0) if o.topic == "chatplane.edge-inbox"]
    finalized = [m for m in sent if isinstance(m, GenerationFinalized)]
    assert len(finalized) == 1 and finalized[0].status is RequestStatus.COMPLETED and finalized[0].output_tokens == 20


def test_a_turn_cancelled_in_queue_commits_an_empty_incomplete_answer_at_once():
    L = Ledger()
    L.create_conversation()
    g = _turn(L, "t1", 0)
    d = L.cancel(g)
    assert types(d)[-1] == "ConversationAnswerCommitted"
    assert (d.events[-1].status, d.events[-1].spooled, d.events[-1].revision) == ("incomplete", False, 2)
    assert L.turn("t2", 2).outcome.kind is OutcomeKind.ADMITTED


def test_a_fenced_turn_and_a_lapsed_turn_commit_incomplete_answers():
    L = Ledger()
    L.create_conversation()
    g = _turn(L, "t1", 0)
    L.accept(g)
    L.advance(L.policy.lease_ms + 1)
    d = L.reconcile()
    assert "GenerationFailed" in types(d) and d.events[-1].status == "incomplete"
    g2 = _turn(L, "t2", 2)
    L.advance(L.policy.queue_wait_max_ms + L.policy.reconcile_grace_ms + 1)
    d = L.reconcile()
    assert "GenerationReturnedToAdmission" in types(d) and d.events[-1].revision == 4
    # Its same-key retry is not re-run under the conversation: the revision moved on.
    assert L.turn("t2", 2).outcome.code is RejectionCode.CONVERSATION_CONFLICT
    assert L.record(g2).status is RequestStatus.ADMISSION_RETRYABLE


def test_regenerate_appends_no_user_turn_and_replaces_the_last_answer():
    L = Ledger()
    L.create_conversation()
    assert L.turn("r0", 0, regenerate=True).outcome.code is RejectionCode.INVALID_REQUEST
    _answered(L, "t1", 0)
    used = L.window().used
    d = L.turn("r1", 2, regenerate=True)
    assert d.outcome.kind is OutcomeKind.ADMITTED and d.events[-1].revision == 2 and d.events[-1].regenerate
    g = d.outcome.generation_id
    L.accept(g)
    L.report(g, answer_spooled=True)
    commit = L.commit_answer(g).events[0]
    assert (commit.revision, commit.replaces_seq) == (3, 2)
    assert L.window().used == used + 1  # a new quota decision


def test_delete_cancels_the_running_turn_and_nothing_is_appended_afterwards():
    L = Ledger()
    L.create_conversation()
    g = _turn(L, "t1", 0)
    L.accept(g)
    d = L.delete_conversation()
    assert types(d) == ["CancelRequested", "ConversationDeleted"]
    assert L.delete_conversation().outcome.kind is OutcomeKind.EXISTING  # idempotent
    assert L.turn("t2", 2).outcome.code is RejectionCode.NOT_FOUND
    before = L.state
    report = L.report(g, outcome=FinishOutcome.STOPPED, answer_spooled=True)
    assert "ConversationAnswerPending" not in types(report)
    # Its end is announced at once: no answer will commit to a deleted conversation.
    sent = [
        decode_message(o.value)
        for o in route(topics.Topology("t"), before, L.state, L.submit_cmd("x"), report, 0)
        if o.topic == "chatplane.edge-inbox"
    ]
    assert any(isinstance(m, GenerationFinalized) for m in sent)
    assert L.commit_answer(g).events == ()
    assert L.create_conversation().outcome.code is RejectionCode.NOT_FOUND  # its id stays dead


def test_an_unknown_or_foreign_conversation_is_not_found():
    L = Ledger()
    assert L.turn("t1", 0, conversation_id="conv_other").outcome.code is RejectionCode.NOT_FOUND
    assert L.delete_conversation("conv_other").outcome.code is RejectionCode.NOT_FOUND


def test_idle_conversations_are_parked_and_restored_from_the_stored_revision():
    L = Ledger()
    L.create_conversation()
    _answered(L, "t1", 0)
    assert next_deadline_ms(L.state, L.policy) <= L.now_ms + L.policy.conversation_idle_park_ms
    L.advance(L.policy.conversation_idle_park_ms)
    d = L.reconcile()
    assert types(d) == ["ConversationParked"] and d.events[0].revision == 2
    assert "conv_a" not in L.state.conversations
    # Without the stored revision (or past its deadline) a parked conversation is unknown.
    assert L.turn("t2", 2).outcome.code is RejectionCode.NOT_FOUND
    assert L.turn("t2", 2, restore_revision=2, decide_by_ms=0).outcome.code is RejectionCode.NOT_FOUND
    d = L.turn("t2", 2, restore_revision=2)
    assert types(d) == ["GenerationAdmitted", "ConversationRestored", "ConversationTurnCommitted"]
    assert d.events[-1].revision == 3


def test_the_hot_state_is_bounded_parking_the_least_recently_used_idle_conversation():
    L = Ledger(policy=Policy(conversations_hot_max=3))
    for name in ("c1", "c2", "c3"):
        L.create_conversation(name)
        L.advance(1_000)
    refused = L.create_conversation("c4").outcome
    assert refused.code is RejectionCode.RATE_LIMITED and refused.details.limit == 3
    L.advance(L.policy.conversation_park_min_idle_ms)
    d = L.create_conversation("c4")
    assert types(d) == ["ConversationParked", "ConversationCreated"] and d.events[0].conversation_id == "c1"
    assert set(L.state.conversations) == {"c2", "c3", "c4"}


def test_tombstones_are_forgotten_after_their_retention_and_bounded():
    L = Ledger(policy=Policy(conversation_tombstones_max=2))
    for name in ("c1", "c2", "c3"):
        L.create_conversation(name)
    L.delete_conversation("c1")
    L.delete_conversation("c2")
    assert L.delete_conversation("c3").outcome.code is RejectionCode.RATE_LIMITED
    L.advance(L.policy.conversation_park_min_idle_ms)
    d = L.delete_conversation("c3")
    assert types(d) == ["ConversationForgotten", "ConversationDeleted"]
    L.advance(L.policy.conversation_tombstone_ms)
    assert {e.conversation_id for e in L.reconcile().events} == {"c2", "c3"}
    assert L.state.conversation_tombstones == {}


def test_the_monitor_reports_a_turn_appended_to_a_deleted_conversation_and_a_revision_gap():
    m = InvariantMonitor()
    base = dict(command_id="c", user_id="u", occurred_at_ms=1)
    assert m.observe(ev.ConversationCreated(event_id="c/0", generation_id="", conversation_id="x", **base)) == []
    gap = m.observe(ev.ConversationTurnCommitted(event_id="c/1", generation_id="g1", conversation_id="x", revision=3, regenerate=False, **base))
    assert [v.invariant for v in gap] == [10]
    m.observe(ev.ConversationDeleted(event_id="c/2", generation_id="", conversation_id="x", revision=3, **base))
    late = m.observe(ev.ConversationAnswerCommitted(event_id="c/3", generation_id="g1", conversation_id="x", revision=4, epoch=1, status="completed", spooled=True, replaces_seq=0, **base))
    assert any("deleted" in v.message for v in late)


def test_a_stateless_request_is_unchanged_by_conversations():
    L = Ledger()
    d = L.submit("plain")
    assert types(d) == ["GenerationAdmitted"] and d.outcome.conversation_id is None


def test_a_same_key_retry_of_a_turn_is_answered_with_its_conversation_and_revision_as_the_first_answer_was():
    """The phone retries a turn it never heard the end of: the retry names the turn's conversation and
    the revision its user message committed at (the next turn sends that + 1), whatever the turn's
    end, later turns included; a stateless retry names none."""
    L = Ledger()
    L.create_conversation()
    g = _answered(L, "t1", 0)
    first = L.turn("t1", 0)
    assert first.events == () and first.outcome.kind is OutcomeKind.EXISTING and first.outcome.generation_id == g
    assert (first.outcome.status, first.outcome.conversation_id, first.outcome.revision) == (RequestStatus.COMPLETED, "conv_a", 1)
    # A turn still running: the retry is told to follow it, with the same fields.
    g2 = _turn(L, "t2", 2)
    running = L.turn("t2", 2).outcome
    assert running.code is RejectionCode.GENERATION_IN_PROGRESS and running.same_request
    assert (running.generation_id, running.conversation_id, running.revision) == (g2, "conv_a", 3)
    # Cancelled in its queue: its (incomplete) answer committed at 4 all the same.
    L.cancel(g2)
    cancelled = L.turn("t2", 2).outcome
    assert (cancelled.kind, cancelled.status, cancelled.conversation_id, cancelled.revision) == (
        OutcomeKind.EXISTING, RequestStatus.CANCELLED, "conv_a", 3,
    )
    # A regeneration's answer replaces the answer at its revision, and its retry says so.
    r = L.turn("r1", 4, regenerate=True).outcome.generation_id
    L.accept(r)
    L.report(r, answer_spooled=True)
    L.commit_answer(r)
    regenerated = L.turn("r1", 4, regenerate=True).outcome
    assert (regenerated.status, regenerated.conversation_id, regenerated.revision) == (RequestStatus.COMPLETED, "conv_a", 4)
    # The first turn's retry, long after: still its own revision, not the conversation's.
    assert L.turn("t1", 0).outcome.revision == 1
    # Past the result's retention: result_unavailable, still naming the turn.
    L.advance(L.policy.result_ttl_ms)
    gone = L.turn("t1", 0).outcome
    assert gone.code is RejectionCode.RESULT_UNAVAILABLE and (gone.conversation_id, gone.revision) == ("conv_a", 1)
    plain = L.submit("plain")
    L.accept(plain.outcome.generation_id)
    L.report(plain.outcome.generation_id)
    again = L.submit("plain").outcome
    assert again.kind is OutcomeKind.EXISTING and (again.conversation_id, again.revision) == (None, None)


def test_a_record_stored_before_turns_kept_their_revision_is_read_and_answered_without_one():
    from control_plane.codec import dump_aggregate, load_aggregate
    import orjson

    L = Ledger()
    L.create_conversation()
    g = _answered(L, "t1", 0)
    doc = orjson.loads(dump_aggregate(L.aggregate))
    for record in doc["ledger"]["requests"].values():
        del record["turn_revision"]  # as an older process stored it
    old = load_aggregate(orjson.dumps(doc))
    assert old.ledger.record_of(g).turn_revision == 0 and old.ledger.record_of(g).conversation_id == "conv_a"
    L.aggregate = old
    retry = L.turn("t1", 0).outcome
    assert retry.kind is OutcomeKind.EXISTING and retry.generation_id == g
    assert (retry.conversation_id, retry.revision) == (None, None)  # unknown, so not guessed


def test_the_codec_round_trips_conversations_and_reads_older_values():
    from control_plane.codec import dump_aggregate, load_aggregate

    L = Ledger()
    L.create_conversation()
    _turn(L, "t1", 0)
    L.delete_conversation("conv_a")
    L.create_conversation("conv_b")
    back = load_aggregate(dump_aggregate(L.aggregate))
    assert back.ledger == L.state
    assert replace(L.state, conversations={}, conversation_tombstones={}).conversations == {}


def test_a_pending_answer_commits_even_after_its_request_record_was_purged():
    # Found by the simulator (seed 1): the writer came back after the record's retention had passed,
    # and the conversation waited for that answer forever.
    L = Ledger()
    L.create_conversation()
    g = _turn(L, "t1", 0)
    L.accept(g)
    L.report(g, answer_spooled=True)
    L.advance(L.policy.dedup_retention_ms + 1)
    assert "DedupRecordPurged" in types(L.reconcile())
    assert L.record(g) is None
    d = L.commit_answer(g)
    assert types(d) == ["ConversationAnswerCommitted"] and d.events[0].status == "completed"
    assert L.state.conversations["conv_a"].in_flight == ""


def test_the_processor_table_layout_keeps_conversations_and_tombstones():
    from projections.ledger.table_store import EMPTY_LAYOUT, join, plan

    L = Ledger()
    L.create_conversation()
    _turn(L, "t1", 0)
    L.create_conversation("conv_b")
    L.delete_conversation("conv_b")
    table = dict(plan(L.aggregate, EMPTY_LAYOUT, L.policy).puts)
    back, _ = join(table[L.user_id.encode()], table.get, L.policy)
    assert back.ledger.conversations == L.state.conversations
    assert back.ledger.conversation_tombstones == L.state.conversation_tombstones
