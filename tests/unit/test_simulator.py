"""The seeded simulator: several seeds must pass, and deliberately broken cores must be caught.

The broken-core tests are what make the passing seeds mean something: each breaks one rule the
invariants protect (the quota check, single consumption, the retired-window fix, the command memory)
and asserts the simulator reports it with its seed and step.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

import control_plane.aggregate as aggregate_module
from control_plane.decide import Decision, decide
from control_plane.evolve import evolve
from control_plane.simulator import SimConfig, SimulationFailed, simulate
from control_plane.state import reservation_id
from schemas import commands as cmd
from schemas import events as ev
from schemas.messages import OutcomeKind

# 8 x 25,000 = 200,000 steps before draining; about 10 s on a 2-core machine.
SEEDS = range(1, 1 + int(os.environ.get("CHATPLANE_SIM_SEEDS", "8")))
STEPS = int(os.environ.get("CHATPLANE_SIM_STEPS", "25000"))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_run_keeps_every_invariant(seed: int) -> None:
    sim = simulate(seed, STEPS)
    summary, stats = sim.summary(), sim.stats
    assert stats.steps >= STEPS
    # The run exercised what it claims to: faults happened and every path was taken.
    assert stats.processor_crashes > 0 and stats.worker_crashes > 0
    assert stats.messages_dropped > 0 and stats.messages_duplicated > 0 and stats.commands_lost > 0
    assert stats.commands_redelivered > 0 and stats.edge_timeouts > 0
    assert set(summary["terminal"]) == {"completed", "cancelled", "failed"}
    assert summary["messages_consumed"] > 0 and summary["messages_released"] > 0
    rejected = {e.code for e in sim.ledger.values() if isinstance(e, ev.AdmissionRejected)}
    assert {"quota_exhausted", "concurrency_limited"} <= set(rejected)
    assert stats.rejections["idempotency_keys_exhausted"] > 0, "no new key met the records bound"
    kinds = {type(e) for e in sim.ledger.values()}
    for needed in (ev.QuotaWindowRetired, ev.DedupRecordPurged, ev.AttemptFenced, ev.LateReportIgnored, ev.CancelRequested):
        assert needed in kinds, needed.__name__


def test_the_final_reconcile_alone_settles_work_cut_off_mid_flight() -> None:
    # No time to drain: whatever is queued or running when the run stops is settled by the one
    # reconcile past every deadline (lease expiry fences, records usage, releases or keeps the message).
    settled = 0
    for seed in (11, 12, 13):
        sim = simulate(seed, 3_000, SimConfig(drain_ms=0))
        settled += sum(
            1 for e in sim.ledger.values() if isinstance(e, ev.AttemptFenced) and e.command_id.startswith("reconcile:")
        )
    assert settled > 0


def test_the_same_seed_replays_the_same_run() -> None:
    a, b = simulate(7, 5_000), simulate(7, 5_000)
    assert a.stats == b.stats
    assert list(a.ledger) == list(b.ledger)


def _expect_failure(seeds: range, steps: int, *invariants: str, config: SimConfig | None = None) -> str:
    """Run seeds until one fails; the message must name the seed, the step and the invariant."""
    for seed in seeds:
        try:
            simulate(seed, steps, config)
        except SimulationFailed as exc:
            message = str(exc)
            assert re.match(rf"SIMULATOR FAILED seed={seed} step=\d+: ", message), message
            assert any(invariant in message for invariant in invariants), message
            return message
    raise AssertionError(f"no seed in {seeds} caught the broken core")


def _broken(monkeypatch: pytest.MonkeyPatch, wrapper) -> None:
    monkeypatch.setattr(aggregate_module, "decide", wrapper)


def test_a_core_that_skips_the_quota_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def decide_without_quota(state, command, policy):
        if isinstance(command, cmd.SubmitGeneration):
            # Admit as if the window were empty: the over-admission must not go unnoticed.
            state = dataclasses.replace(state, windows={})
        return decide(state, command, policy)

    _broken(monkeypatch, decide_without_quota)
    _expect_failure(range(1, 4), 10_000, "invariant 1")


def test_a_core_that_consumes_again_on_a_repeated_acceptance_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def decide_double_consume(state, command, policy):
        decision = decide(state, command, policy)
        if isinstance(command, cmd.AcceptAttempt) and decision.outcome.kind is OutcomeKind.EXISTING:
            record = state.record_of(command.generation_id)
            if record.attempt is not None:
                again = ev.ReservationConsumed(
                    event_id=f"{command.command_id}/0",
                    command_id=command.command_id,
                    user_id=command.user_id,
                    generation_id=record.generation_id,
                    occurred_at_ms=command.issued_at_ms,
                    reservation_id=reservation_id(record.generation_id, record.epoch),
                    window_start_ms=record.attempt.window_start_ms,
                    epoch=record.epoch,
                )
                return Decision((again,), decision.outcome)
        return decision

    _broken(monkeypatch, decide_double_consume)
    # The monitor sees the window's counter disagree with the history (2) or the second consumption
    # itself (3); either report is the catch.
    _expect_failure(range(1, 6), 20_000, "invariant 2", "invariant 3")


def test_the_core_before_the_retired_window_fix_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def decide_reopening_retired_windows(state, command, policy):
        if isinstance(command, cmd.SubmitGeneration):
            state = dataclasses.replace(state, open_windows_from_ms=0)
        return decide(state, command, policy)

    _broken(monkeypatch, decide_reopening_retired_windows)
    # Late submits land in a retired window only when a slow delivery straddles a boundary. A command
    # decided again after a crash into a reopened window also differs from its first decision, which
    # the event-id check catches first on some seeds (seed 1 since outputs wait for the ledger).
    _expect_failure(range(1, 11), 25_000, "invariant 1", "invariant 0", config=SimConfig(net_slow_p=0.2))


def test_the_core_before_the_usage_window_fix_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def decide_losing_the_usage_window(state, command, policy):
        decision = decide(state, command, policy)
        events = tuple(
            dataclasses.replace(e, window_start_ms=0)
            # Before the fix a usage record took its window from the reservation, which the window's
            # retirement drops: a generation that outlived its window named window 0.
            if isinstance(e, ev.UsageRecorded) and e.window_start_ms not in state.windows
            else e
            for e in decision.events
        )
        return Decision(events, decision.outcome)

    _broken(monkeypatch, decide_losing_the_usage_window)
    _expect_failure(range(1, 4), 25_000, "invariant 8")


def test_a_processor_without_its_command_memory_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Redelivered commands would be decided again against a newer state: same event ids, other content.
    # Most commands are naturally idempotent, so duplicates are made frequent enough to hit one that is not.
    monkeypatch.setattr(aggregate_module.Aggregate, "remembered", lambda self, command_id: None)
    _expect_failure(range(1, 8), 10_000, "invariant 0", config=SimConfig(net_dup_p=0.2))


def test_a_processor_that_does_not_read_its_stamps_back_after_a_crash_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # A submit decided in time whose admission landed on the ledger before the crash is read again,
    # later, after the restart: stamped afresh it is past its deadline and refused under the same
    # event ids. Reading the stamps back from the ledger (projections/ledger/read_stamps.py) keeps it.
    from control_plane.simulator import Processor

    def restart_forgetting_stamps(self: Processor) -> None:
        self.up = True
        self.schedule()

    monkeypatch.setattr(Processor, "restart", restart_forgetting_stamps)
    _expect_failure(range(1, 8), 25_000, "invariant 0")


def test_the_core_that_forgot_keys_within_retention_at_the_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # At the records bound the old core purged the oldest settled record, however young, to
    # admit a new key; a same-key retry of it was then admitted and charged again.
    def decide_purging_the_oldest(state, command, policy):
        full = len(state.requests) >= policy.dedup_records_per_user_max
        if isinstance(command, cmd.SubmitGeneration) and full and command.idempotency_key not in state.requests:
            settled = [r for r in state.requests.values() if not r.status.active]
            if settled:
                oldest = min(settled, key=lambda r: (r.updated_at_ms, r.idempotency_key))
                purge = ev.DedupRecordPurged(
                    event_id=f"{command.command_id}/0",
                    command_id=command.command_id,
                    user_id=command.user_id,
                    generation_id=oldest.generation_id,
                    occurred_at_ms=command.issued_at_ms,
                    idempotency_key=oldest.idempotency_key,
                )
                decision = decide(evolve(state, purge), command, policy)
                renumbered = (
                    dataclasses.replace(e, event_id=f"{command.command_id}/{i}") for i, e in enumerate(decision.events, 1)
                )
                return Decision((purge, *renumbered), decision.outcome)
        return decide(state, command, policy)

    _broken(monkeypatch, decide_purging_the_oldest)
    message = _expect_failure(range(1, 4), 25_000, "invariant 7")
    assert "within its retention" in message, message


# --- the token budget (docs/core.md, "Token budget") -------------------------------------------

TOKEN_CONFIG = SimConfig(token_budget=1_500, token_overshoot_p=0.05)


@pytest.mark.parametrize("seed", range(1, 4))
def test_a_seeded_run_with_the_token_budget_on_keeps_every_invariant(seed: int) -> None:
    sim = simulate(seed, 15_000, TOKEN_CONFIG)
    rejections = sim.stats.rejections
    # Both refusals by tokens happened, and the settlement paths were all taken: reports at and
    # above the reservation (overshoot, some at its bound) and lost reports settled by the timer.
    assert rejections["quota_exhausted:tokens"] > 0 and rejections["concurrency_limited:tokens"] > 0
    usage = [e for e in sim.ledger.values() if isinstance(e, ev.UsageRecorded)]
    assert any(u.overshoot_tokens == TOKEN_CONFIG.token_overshoot_max for u in usage)
    assert any(0 < u.overshoot_tokens < TOKEN_CONFIG.token_overshoot_max for u in usage)
    assert any(u.outcome is None for u in usage)  # settled after a lost report
    assert any(isinstance(e, ev.ReservationReleased) and e.tokens_released for e in sim.ledger.values())
    assert sim.monitor.unsettled_token_reservations() == {}


def test_a_core_that_skips_the_token_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def decide_without_tokens(state, command, policy):
        if isinstance(command, cmd.SubmitGeneration):
            # Decide as if no tokens were used or held in any window: the over-admission must not go unnoticed.
            windows = {k: dataclasses.replace(w, tokens_used=0, tokens_reserved=0) for k, w in state.windows.items()}
            state = dataclasses.replace(state, windows=windows)
        return decide(state, command, policy)

    _broken(monkeypatch, decide_without_tokens)
    _expect_failure(range(1, 4), 10_000, "invariant 11", config=TOKEN_CONFIG)


def test_a_core_that_settles_a_token_reservation_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def decide_settling_twice(state, command, policy):
        decision = decide(state, command, policy)
        if isinstance(command, cmd.ReportAttemptFinished):
            # A release as if it had never started, beside its usage record: a second settlement.
            extra = [
                ev.ReservationReleased(
                    event_id=f"{command.command_id}/{len(decision.events)}", command_id=command.command_id,
                    user_id=e.user_id, generation_id=e.generation_id, occurred_at_ms=e.occurred_at_ms,
                    reservation_id=reservation_id(e.generation_id, e.epoch), window_start_ms=e.window_start_ms,
                    epoch=e.epoch, reason=ev.FenceReason.DECLINED, tokens_released=e.tokens_reserved,
                )
                for e in decision.events
                if isinstance(e, ev.UsageRecorded) and e.tokens_reserved
            ]
            decision = Decision(decision.events + tuple(extra), decision.outcome)
        return decision

    _broken(monkeypatch, decide_settling_twice)
    _expect_failure(range(1, 4), 10_000, "invariant 12", "invariant 3", config=TOKEN_CONFIG)


def test_outputs_sent_beside_their_ledger_entry_are_caught() -> None:
    # The previous processor sent a decision's reply and dispatch beside its ledger entry, before the
    # entry was acknowledged: a crash in between left a dispatch (and an "admitted" reply) for a
    # generation the ledger never recorded. The simulator's processor now holds them until the entry
    # lands, and the world refuses a dispatch whose entry is not on the ledger when it arrives.
    _expect_failure(range(1, 4), 5_000, "delivered before its ledger entry", config=SimConfig(outputs_after_ledger=False))
