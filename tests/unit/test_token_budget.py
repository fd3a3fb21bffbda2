"""The token budget, its settlement rules and account risk classes (docs/core.md, "Token budget").

Given/when/then over the pure core (``tests/unit/ledger_dsl.py``; every step is checked by the
invariant monitor, invariants 11-13 among them). Reservations are ``input_tokens + max_output_tokens``
(12 + ``max_output_tokens`` here).
"""

from __future__ import annotations

import dataclasses

from control_plane.decide import TOKENS, settle_tokens
from control_plane.evolve import evolve_all
from control_plane.invariants import InvariantMonitor
from control_plane.policy import Policy, RiskLimits
from control_plane.state import UserLedger
from schemas import commands as cmd
from schemas import events as ev
from schemas.codes import FinishOutcome, RejectionCode, RequestStatus, Tier
from schemas.messages import OutcomeKind
from schemas.wire import decode_event, encode
from tests.unit.ledger_dsl import Ledger

BUDGET = 1_000


def ledger(budget: int = BUDGET, **policy: object) -> Ledger:
    return Ledger(policy=Policy(token_budget_by_tier={Tier.FREE: budget, Tier.PAID: 0}, concurrency_limit=4, **policy))


def admitted(L: Ledger, key: str, max_output_tokens: int) -> str:
    d = L.submit(key, max_output_tokens=max_output_tokens)
    assert d.outcome.kind is OutcomeKind.ADMITTED, d.outcome
    return d.outcome.generation_id


def usage_of(decision) -> ev.UsageRecorded:
    return next(e for e in decision.events if isinstance(e, ev.UsageRecorded))


def test_off_by_default_no_refusal_by_tokens_but_usage_is_counted():
    L = Ledger(policy=Policy(concurrency_limit=4))
    assert L.policy.token_budget(Tier.FREE) == 0 and L.policy.token_budget(Tier.PAID) == 0
    g = admitted(L, "a", 4_000)
    admitted(L, "b", 4_000)
    assert L.window().token_limit == 0 and L.window().tokens_reserved == 2 * 4_012
    L.accept(g)
    u = usage_of(L.report(g, output_tokens=30))
    assert (u.billable_tokens, u.tokens_reserved, u.overshoot_tokens) == (42, 4_012, 0)
    assert L.window().tokens_used == 42 and L.window().tokens_reserved == 4_012


def test_admission_reserves_input_plus_max_output_in_the_same_decision():
    L = ledger()
    d = L.submit("a", max_output_tokens=488)
    admitted_event = d.events[0]
    assert isinstance(admitted_event, ev.GenerationAdmitted)
    assert (admitted_event.tokens_reserved, admitted_event.token_limit, admitted_event.window_token_limit) == (500, BUDGET, BUDGET)
    assert (L.window().tokens_used, L.window().tokens_reserved) == (0, 500)


def test_room_held_by_running_reservations_is_concurrency_limited_and_settled_usage_is_quota_exhausted():
    L = ledger()
    g = admitted(L, "a", 588)  # 600 reserved of 1,000
    refused = L.submit("b", max_output_tokens=488)  # 500 more: only a's reservation is in the way
    assert refused.outcome.code is RejectionCode.CONCURRENCY_LIMITED
    assert refused.outcome.details.kind == TOKENS and refused.outcome.details.retry_after_ms
    assert L.record(refused.outcome.generation_id).status is RequestStatus.ADMISSION_RETRYABLE
    assert L.window().tokens_reserved == 600  # the refusal held nothing
    L.accept(g)
    L.report(g, output_tokens=588)  # a used all of it: 600 settled
    exhausted = L.submit("b", max_output_tokens=488)  # same key, decided again: settled usage leaves no room
    assert exhausted.outcome.code is RejectionCode.QUOTA_EXHAUSTED
    details = exhausted.outcome.details
    assert (details.kind, details.limit, details.remaining) == (TOKENS, BUDGET, 400)
    assert details.reset_at_ms == L.policy.window_start_ms(L.now_ms) + L.policy.window_ms
    # A same-key retry answers the same refusal, with the same kind.
    again = L.submit("b", max_output_tokens=488)
    assert again.outcome.code is RejectionCode.QUOTA_EXHAUSTED and again.outcome.details.kind == TOKENS
    assert again.events == ()
    # What still fits is admitted.
    admitted(L, "c", 388)
    assert L.window().tokens_used + L.window().tokens_reserved == BUDGET


def test_a_cancelled_generation_settles_to_what_it_generated_and_the_rest_admits_another():
    L = ledger()
    g = admitted(L, "a", 988)  # the whole budget
    assert L.submit("b", max_output_tokens=488).outcome.code is RejectionCode.CONCURRENCY_LIMITED
    L.accept(g)
    L.renew(g, output_tokens=40)
    L.cancel(g)
    u = usage_of(L.report(g, outcome=FinishOutcome.STOPPED, output_tokens=50, delivered_tokens=45))
    assert (u.input_tokens, u.output_tokens, u.delivered_tokens, u.requested_output_tokens) == (12, 50, 45, 988)
    assert (u.billable_tokens, u.overshoot_tokens) == (62, 0)
    assert L.record(g).status is RequestStatus.CANCELLED
    assert (L.window().tokens_used, L.window().tokens_reserved) == (62, 0)
    admitted(L, "b", 488)  # the freed remainder


def test_the_admissions_input_count_is_authoritative():
    L = ledger()
    g = admitted(L, "a", 100)
    L.accept(g)
    report = cmd.ReportAttemptFinished(
        **L._base(generation_id=g, epoch=1, worker_id="w1", outcome=FinishOutcome.COMPLETED, input_tokens=500, output_tokens=10)
    )  # a worker counting the prompt otherwise
    u = usage_of(L.run(report))
    assert u.input_tokens == 12 and u.billable_tokens == 22


def test_a_report_above_the_reservation_is_charged_in_full_as_overshoot_up_to_its_bound():
    L = ledger(budget=10_000, token_overshoot_max=100)
    g = admitted(L, "a", 88)  # 100 reserved
    L.accept(g)
    u = usage_of(L.report(g, output_tokens=150))  # 162 used: 62 over
    assert (u.billable_tokens, u.overshoot_tokens, u.output_tokens) == (162, 62, 150)
    h = admitted(L, "b", 88)
    L.accept(h)
    u = usage_of(L.report(h, output_tokens=5_000))  # far past: charged at the bound, generated kept
    assert (u.billable_tokens, u.overshoot_tokens, u.output_tokens) == (200, 100, 5_000)
    w = L.window()
    assert (w.tokens_used, w.tokens_overshoot, w.tokens_reserved) == (362, 162, 0)


def test_overshoot_is_the_only_way_past_the_budget_and_is_recorded():
    L = ledger(budget=200, token_overshoot_max=50)
    g = admitted(L, "a", 188)  # the whole budget
    L.accept(g)
    L.report(g, output_tokens=230)  # 242 > 200: 42 over, never dropped
    w = L.window()
    assert (w.tokens_used, w.tokens_overshoot) == (242, 42)
    refused = L.submit("b", max_output_tokens=1)
    assert refused.outcome.code is RejectionCode.QUOTA_EXHAUSTED and refused.outcome.details.remaining == 0


def test_a_lost_report_settles_at_the_last_renewal_plus_the_bound():
    L = ledger(token_lost_report_bound=64)
    g = admitted(L, "a", 488)  # 500 reserved
    L.accept(g)
    L.renew(g, output_tokens=100)
    L.advance(L.policy.lease_ms + 1)  # the worker was killed: no renewal, no report
    u = usage_of(L.reconcile())
    assert u.terminal_reason == "lease_expired" and u.outcome is None
    assert (u.output_tokens, u.billable_tokens, u.overshoot_tokens) == (100, 12 + 100 + 64, 0)
    assert (L.window().tokens_used, L.window().tokens_reserved) == (176, 0)
    # The bound never charges more than the reservation.
    h = admitted(L, "b", 88)  # 100 reserved
    L.accept(h)
    L.renew(h, output_tokens=80)
    L.advance(L.policy.lease_ms + 1)
    assert usage_of(L.reconcile()).billable_tokens == 100


def test_an_attempt_that_never_started_releases_its_whole_reservation():
    L = ledger()
    g = admitted(L, "a", 488)
    d = L.decline(g)
    released = next(e for e in d.events if isinstance(e, ev.ReservationReleased))
    assert released.tokens_released == 500
    assert L.window().tokens_reserved == 0 and L.window().tokens_used == 0
    # Retried by its key: reserved again under the next epoch, settled on its own.
    again = L.submit("a", max_output_tokens=488)
    assert again.outcome.kind is OutcomeKind.ADMITTED and again.outcome.epoch == 2
    L.cancel(g)  # cancelled in the queue: released again, never charged
    assert (L.window().tokens_used, L.window().tokens_reserved) == (0, 0)


def test_settlement_rules_as_a_function():
    p = Policy(token_overshoot_max=10, token_lost_report_bound=5)
    assert settle_tokens(100, 10, 20, p, lost=False) == (30, 0)
    assert settle_tokens(100, 10, 95, p, lost=False) == (105, 5)
    assert settle_tokens(100, 10, 500, p, lost=False) == (110, 10)
    assert settle_tokens(100, 10, 20, p, lost=True) == (35, 0)
    assert settle_tokens(100, 10, 88, p, lost=True) == (100, 0)
    assert settle_tokens(0, 10, 20, p, lost=True) == (30, 0)  # admitted before budgets: the actual usage


def test_a_risk_class_from_the_claim_applies_stricter_limits_in_the_same_decision():
    risky = {"elevated": RiskLimits(quota_limit=2, token_budget=300, concurrency_limit=1)}
    L = ledger(budget=0, risk_classes=risky)
    g = L.submit("a", max_output_tokens=88, risk_class="elevated")
    assert g.outcome.kind is OutcomeKind.ADMITTED
    assert g.events[0].risk_class == "elevated" and g.events[0].token_limit == 300
    # burst: one at a time
    assert L.submit("b", max_output_tokens=88, risk_class="elevated").outcome.code is RejectionCode.CONCURRENCY_LIMITED
    # the same account without the claim has the tier's limits (no budget, 4 slots)
    assert L.submit("c", max_output_tokens=4_000).outcome.kind is OutcomeKind.ADMITTED
    L.accept(g.outcome.generation_id)
    L.report(g.outcome.generation_id, output_tokens=88)
    L.cancel(L.submit("c", max_output_tokens=4_000).outcome.generation_id)
    # tokens: 100 settled + 4,012 admitted unclaimed; a claimed one meets its 300 budget
    refused = L.submit("d", max_output_tokens=288, risk_class="elevated")
    assert refused.outcome.code is RejectionCode.QUOTA_EXHAUSTED and refused.outcome.details.kind == TOKENS
    assert refused.outcome.details.limit == 300


def test_a_risk_class_from_the_per_account_setting_and_the_stricter_of_two():
    classes = {
        "elevated": RiskLimits(quota_limit=1),
        "watch": RiskLimits(token_budget=500, concurrency_limit=3),
    }
    L = ledger(budget=0, risk_classes=classes, risk_class_by_user={"user-1": "watch"})
    d = L.submit("a", max_output_tokens=588)  # 600 > 500: the setting's budget applies with no claim
    assert d.outcome.code is RejectionCode.QUOTA_EXHAUSTED and d.outcome.details.kind == TOKENS
    g = admitted(L, "b", 88)
    assert L.record(g).status is RequestStatus.QUEUED
    both = L.submit("c", max_output_tokens=8, risk_class="elevated")  # claim + setting: quota 1, b holds it
    assert both.outcome.code is RejectionCode.QUOTA_EXHAUSTED and both.outcome.details.kind is None
    assert L.policy.risk_limits("user-1", "elevated") == (
        "elevated+watch", RiskLimits(quota_limit=1, token_budget=500, concurrency_limit=3)
    )
    assert L.policy.risk_limits("user-1", "no-such-class") == ("watch", classes["watch"])


def test_usage_query_reports_the_token_budget_beside_the_message_quota():
    L = ledger()
    g = admitted(L, "a", 488)
    L.accept(g)
    L.report(g, output_tokens=100)
    admitted(L, "b", 188)
    d = L.run(cmd.QueryUsage(**L._base(tier=Tier.FREE)))
    u = d.outcome.usage
    assert (u.limit, u.used, u.reserved) == (40, 1, 1)
    assert (u.token_limit, u.tokens_used, u.tokens_reserved, u.tokens_remaining) == (BUDGET, 112, 200, 688)


def test_events_recorded_before_token_budgets_still_replay():
    # A usage record without the token fields reads its charge as input + output; an admission
    # without them reserves nothing, so nothing is left to settle.
    L = Ledger(policy=Policy(concurrency_limit=4))
    g = admitted(L, "a", 100)
    L.accept(g)
    L.report(g, output_tokens=7)
    old = []
    for e in L.all_events:
        doc = {k: v for k, v in dataclasses.asdict(e).items() if k not in {
            "tokens_reserved", "window_token_limit", "token_limit", "risk_class", "requested_output_tokens",
            "delivered_tokens", "billable_tokens", "overshoot_tokens", "tokens_released", "kind", "tokens_used",
        }}
        old.append(decode_event(encode(doc)))
    state = evolve_all(UserLedger("user-1"), old)
    window = next(iter(state.windows.values()))
    assert (window.tokens_used, window.tokens_reserved) == (19, 0)
    monitor = InvariantMonitor(concurrency_limit=4)
    assert monitor.observe_batch(old) == [] and monitor.unsettled_token_reservations() == {}


def test_the_monitor_catches_a_second_settlement_and_an_admission_past_the_budget():
    L = ledger()
    g = admitted(L, "a", 488)
    L.accept(g)
    d = L.report(g, output_tokens=10)
    u = usage_of(d)
    monitor = InvariantMonitor(concurrency_limit=4, token_overshoot_max=L.policy.token_overshoot_max)
    assert monitor.observe_batch(L.all_events) == []
    twice = dataclasses.replace(u, event_id="again/0", command_id="again")
    assert 12 in {v.invariant for v in monitor.observe_batch([twice])}
    # A core without the token check: an admission that does not fit the budget it names.
    over = dataclasses.replace(
        next(e for e in L.all_events if isinstance(e, ev.GenerationAdmitted)),
        event_id="x/0", command_id="x", generation_id="gen_x", idempotency_key="x", reservation_id="gen_x.1",
        tokens_reserved=990, slot_index=1,
    )
    assert 11 in {v.invariant for v in InvariantMonitor(concurrency_limit=4).observe_batch(L.all_events[:1] + [over])}


def test_the_edge_takes_the_risk_class_from_the_tokens_claim():
    from edge.auth import Authenticator, mint
    from edge.settings import EdgeSettings

    settings = EdgeSettings(capacity_check=False, read_model=False)
    auth = Authenticator(settings)
    claimed = auth.authenticate("Bearer " + mint(settings, "risky", Tier.FREE, risk_class="elevated"))
    assert (claimed.user_id, claimed.risk_class) == ("risky", "elevated")
    assert auth.authenticate("Bearer " + mint(settings, "plain", Tier.PAID)).risk_class == ""


def test_budgets_and_risk_classes_come_from_the_environment(monkeypatch):
    import pytest

    from infra.runtime.settings import SettingsError, policy_from_env

    assert policy_from_env().token_budget_by_tier == {Tier.FREE: 0, Tier.PAID: 0}  # off by default
    monkeypatch.setenv("CHATPLANE_TOKEN_BUDGET_FREE", "50000")
    monkeypatch.setenv("CHATPLANE_TOKEN_OVERSHOOT_MAX", "64")
    monkeypatch.setenv("CHATPLANE_TOKEN_LOST_REPORT_BOUND", "128")
    monkeypatch.setenv("CHATPLANE_RISK_CLASSES", "elevated=10/20000/1,watch=-/500/-")
    monkeypatch.setenv("CHATPLANE_ACCOUNT_RISK_CLASSES", "u1=watch, u2=elevated")
    p = policy_from_env()
    assert p.token_budget_by_tier == {Tier.FREE: 50_000, Tier.PAID: 0}
    assert (p.token_overshoot_max, p.token_lost_report_bound) == (64, 128)
    assert p.risk_classes["watch"] == RiskLimits(token_budget=500) and p.risk_class_by_user == {"u1": "watch", "u2": "elevated"}
    for bad in ("elevated=10/20000", "Bad=1/2/3", "x=1/2/0", "x=-1/2/3"):
        monkeypatch.setenv("CHATPLANE_RISK_CLASSES", bad)
        with pytest.raises(SettingsError, match="CHATPLANE_RISK_CLASSES"):
            policy_from_env()
