"""The processor's view of edge liveness (projections/ledger/presence.py): an edge is lost only after
its lease of silence while the presence log was flowing; a Kafka outage makes nobody lost."""

from __future__ import annotations

from projections.ledger.presence import PresenceView
from schemas.messages import EdgePresence

LEASE_MS = 3_000


def beat(edge_id: str, interval_ms: int = 1_000) -> EdgePresence:
    return EdgePresence(edge_id=edge_id, sent_at_ms=0, interval_ms=interval_ms)


def flowing(view: PresenceView, start_ms: int, end_ms: int, step_ms: int = 500, beats: tuple[str, ...] = ()) -> None:
    """The broker answers a fetch every ``step_ms`` from start to end; ``beats`` are heard each time."""
    for t in range(start_ms, end_ms + 1, step_ms):
        view.responded(t)
        for edge_id in beats:
            view.observe(beat(edge_id), t)


def test_an_edge_silent_for_its_lease_is_lost_and_one_that_beats_is_not():
    view = PresenceView(LEASE_MS, edges_max=10)
    flowing(view, 0, 10_000, beats=("a", "b"))
    flowing(view, 10_500, 13_000, beats=("a",))  # b falls silent after 10,000
    assert not view.lost("a", 13_000)
    assert not view.lost("b", 13_000), "silent for exactly its lease: not yet"
    flowing(view, 13_500, 13_500, beats=("a",))
    assert view.lost("b", 13_500)
    assert not view.lost("", 13_500), "no reader named: never lost"


def test_nobody_is_judged_while_the_log_does_not_answer_nor_for_a_lease_after_it_does_again():
    view = PresenceView(LEASE_MS, edges_max=10)
    flowing(view, 0, 5_000, beats=("a",))
    # The broker is down from 5,000 to 20,000: no fetch responses, no beats.
    assert not view.lost("a", 20_000), "an outage of Kafka is not the death of every edge"
    flowing(view, 20_000, 22_500)  # answers again, a has not beaten yet
    assert not view.lost("a", 22_500), "every edge gets a whole lease once the log flows again"
    flowing(view, 23_000, 23_500)
    assert view.lost("a", 23_500)


def test_a_processor_that_just_started_waits_a_lease_even_for_an_edge_it_never_heard():
    view = PresenceView(LEASE_MS, edges_max=10)
    flowing(view, 0, 2_500)
    assert not view.lost("never-heard", 2_500)
    flowing(view, 3_000, 3_500)
    assert view.lost("never-heard", 3_500)


def test_a_slow_beating_edge_gets_three_of_its_intervals():
    view = PresenceView(LEASE_MS, edges_max=10)
    flowing(view, 0, 1_000)
    view.observe(beat("slow", interval_ms=5_000), 1_000)
    flowing(view, 1_500, 15_500)
    assert not view.lost("slow", 15_500)
    flowing(view, 16_000, 16_500)
    assert view.lost("slow", 16_500)


def test_the_view_is_bounded_least_recently_heard_first():
    view = PresenceView(LEASE_MS, edges_max=2)
    for i, edge_id in enumerate(("a", "b", "c")):
        view.observe(beat(edge_id), i)
    assert len(view) == 2


def test_a_short_lease_still_judges_when_fetch_responses_come_as_slowly_as_a_loaded_poll():
    """A 1.5 s lease with the broker answering every 900 ms (a 500 ms empty long poll plus a loaded
    event loop): the log is flowing, so an edge silent for its lease is lost. With half the lease
    (750 ms) as the only bound, every response restarted the grace and the edge was never judged."""
    view = PresenceView(1_500, edges_max=10)
    flowing(view, 0, 5_400, step_ms=900, beats=("a", "b"))
    flowing(view, 6_300, 9_000, step_ms=900, beats=("a",))  # b falls silent after 5,400
    assert view.lost("b", 9_000)
    assert not view.lost("a", 9_000)
