"""A small given/when/then harness over the pure core: builds commands, runs ``handle``, checks invariants."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from control_plane.aggregate import Aggregate, handle
from control_plane.decide import Decision
from control_plane.invariants import InvariantMonitor
from control_plane.policy import ModelEntry, Policy
from schemas import commands as cmd
from schemas.codes import FinishOutcome, Tier
from schemas.commands import ReplyTo

# 2026-11-06T15:00:00Z: the start of a UTC 3-hour window (15:00-18:00), as in the seed's example.
T0 = 1_762_441_200_000
REPLY = ReplyTo(topic="chatplane.edge-inbox", partition=0, request_id="req")
# The core's view of the default catalog's model (infra/models/models.toml).
TEST_MODELS = {
    "fast-text-model": ModelEntry(
        "fast-text-model", "smollm2-135m-instruct-q4_1@sha256:b179c9523d0e", "smollm2-135m-instruct-q4_1", frozenset(Tier)
    ),
}


@dataclass
class Ledger:
    user_id: str = "user-1"
    policy: Policy = field(default_factory=Policy)
    now_ms: int = T0
    tier: Tier = Tier.FREE

    def __post_init__(self) -> None:
        if not self.policy.models:  # a policy given for its limits only gets the test models
            self.policy = replace(self.policy, models=TEST_MODELS)
        self.aggregate = Aggregate.empty(self.user_id)
        self.monitor = InvariantMonitor(
            concurrency_limit=self.policy.concurrency_limit,
            dedup_retention_ms=self.policy.dedup_retention_ms,
            records_max=self.policy.dedup_records_per_user_max,
            token_overshoot_max=self.policy.token_overshoot_max,
        )
        self._ids = itertools.count(1)
        self.all_events: list[Any] = []

    @property
    def state(self):
        return self.aggregate.ledger

    def advance(self, ms: int) -> None:
        self.now_ms += ms

    def run(self, command: Any) -> Decision:
        self.aggregate, decision, _ = handle(self.aggregate, command, self.policy)
        violations = self.monitor.observe_batch(decision.events)
        assert not violations, violations
        self.all_events.extend(decision.events)
        return decision

    def _base(self, **fields: Any) -> dict[str, Any]:
        base = {"command_id": f"c{next(self._ids)}", "user_id": self.user_id, "issued_at_ms": self.now_ms}
        base.update(fields)
        return base

    def submit_cmd(self, key: str = "k1", fingerprint: str = "fp-aaaaaaaa", **over: Any) -> cmd.SubmitGeneration:
        fields = dict(
            idempotency_key=key,
            fingerprint=fingerprint,
            model_alias="fast-text-model",
            tier=self.tier,
            stream=True,
            max_output_tokens=1000,
            input_tokens=12,
            reply_to=REPLY,
        )
        fields.update(over)
        return cmd.SubmitGeneration(**self._base(**fields))

    def submit(self, key: str = "k1", fingerprint: str = "fp-aaaaaaaa", **over: Any) -> Decision:
        return self.run(self.submit_cmd(key, fingerprint, **over))

    def accept(self, generation_id: str, epoch: int = 1, worker: str = "w1", **over: Any) -> Decision:
        return self.run(
            cmd.AcceptAttempt(**self._base(generation_id=generation_id, epoch=epoch, worker_id=worker, **over))
        )

    def decline(self, generation_id: str, epoch: int = 1, worker: str = "w1", reason: str = "queue_deadline") -> Decision:
        return self.run(
            cmd.DeclineAttempt(**self._base(generation_id=generation_id, epoch=epoch, worker_id=worker, reason=reason))
        )

    def renew(self, generation_id: str, epoch: int = 1, worker: str = "w1", output_tokens: int = 0) -> Decision:
        return self.run(
            cmd.RenewLease(
                **self._base(generation_id=generation_id, epoch=epoch, worker_id=worker, output_tokens=output_tokens)
            )
        )

    def cancel(self, generation_id: str, **over: Any) -> Decision:
        return self.run(cmd.CancelGeneration(**self._base(generation_id=generation_id, **over)))

    def detach(self, generation_id: str, reader: str = "", grace_ms: int = 5_000, **over: Any) -> Decision:
        return self.run(
            cmd.DetachReader(**self._base(generation_id=generation_id, reader_id=reader, grace_ms=grace_ms, **over))
        )

    def attach(self, generation_id: str, reader: str) -> Decision:
        return self.run(cmd.AttachReader(**self._base(generation_id=generation_id, reader_id=reader)))

    def report(
        self,
        generation_id: str,
        outcome: FinishOutcome = FinishOutcome.COMPLETED,
        epoch: int = 1,
        worker: str = "w1",
        output_tokens: int = 20,
        **over: Any,
    ) -> Decision:
        return self.run(
            cmd.ReportAttemptFinished(
                **self._base(
                    generation_id=generation_id,
                    epoch=epoch,
                    worker_id=worker,
                    outcome=outcome,
                    input_tokens=12,
                    output_tokens=output_tokens,
                    **over,
                )
            )
        )

    def create_conversation(self, conversation_id: str = "conv_a") -> Decision:
        return self.run(cmd.CreateConversation(**self._base(conversation_id=conversation_id, reply_to=REPLY)))

    def delete_conversation(self, conversation_id: str = "conv_a", **over: Any) -> Decision:
        return self.run(cmd.DeleteConversation(**self._base(conversation_id=conversation_id, reply_to=REPLY, **over)))

    def turn(self, key: str, expected_revision: int, conversation_id: str = "conv_a", **over: Any) -> Decision:
        fields = dict(conversation_id=conversation_id, expected_revision=expected_revision, decide_by_ms=self.now_ms + 5_000)
        fields.update(over)
        return self.submit(key, fingerprint=f"fp-{key}-{expected_revision}", **fields)

    def commit_answer(self, generation_id: str, conversation_id: str = "conv_a", epoch: int = 1) -> Decision:
        return self.run(
            cmd.CommitAnswer(**self._base(conversation_id=conversation_id, generation_id=generation_id, epoch=epoch))
        )

    def reconcile(self) -> Decision:
        return self.run(cmd.ReconcileDue(**self._base(as_of_ms=self.now_ms)))

    def window(self):
        return self.state.windows[self.policy.window_start_ms(self.now_ms)]

    def record(self, generation_id: str):
        return self.state.record_of(generation_id)


def types(decision: Decision) -> list[str]:
    return [type(e).__name__ for e in decision.events]
