"""The HTTP edge and its clients: new requests (plain ones, and conversation creates, deletes and
turns), same-key retries on a timeout, cancels, readers that detach and come back.

Data flow: ``new_request`` fires per user every ``request_gap_ms`` (until the world drains) and
issues commands through ``world.append_command``, each with a reply address on the edge inbox and a
request id in ``pending``; ``timeout`` retries what got no answer in time. The processor's answers
come back through the world's last hop: ``on_outcome`` (an ``Outcome`` for one of its requests:
admitted, refused, a conversation's revision) and ``on_finalized`` (a ``GenerationFinalized``).
The edge checks one thing itself: an ``idempotency_conflict`` only for a key it did send with two
contents.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from control_plane.simulator.config import MODEL_ALIAS
from control_plane.simulator.world import World
from schemas import commands as cmd
from schemas.codes import CancelReason, RejectionCode, RequestStatus, Tier
from schemas.messages import GenerationFinalized, Outcome, OutcomeKind


@dataclass
class Request:
    """One logical client request: an idempotency key and its content, across retries."""

    user: str
    key: str
    fingerprint: str
    tier: Tier
    max_output_tokens: int
    tries: int = 0
    admission_retries: int = 0
    generation_id: str | None = None
    cancel_tries: int = 0
    conversation_id: str = ""
    expected_revision: int = 0
    regenerate: bool = False


# Readers: every submit names the simulated edge; a share of cancels are a client going away
# instead (DetachReader with a random grace), some of which come back (AttachReader).
READER_ID = "sim-edge"
DETACH_P = 0.4
DETACH_GRACE_MS_MAX = 3_000
REATTACH_P = 0.3


class Edge:
    """The HTTP edge and its clients: submits with timeouts and same-key retries, cancels."""

    def __init__(self, sim: World) -> None:
        self.sim = sim
        self.pending: dict[str, tuple[str, Request]] = {}  # request id -> (kind, request) awaiting an outcome
        self.by_generation: dict[str, Request] = {}
        self.history: dict[str, list[Request]] = defaultdict(list)
        self.fingerprints: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.clock_skew_ms = sim.skew()
        # The client's view of its conversations: id -> the revision it believes committed.
        self.conversations: dict[str, dict[str, int]] = defaultdict(dict)
        self.deadline_clock_skew_ms = sim.rng.randint(-sim.config.decision_clock_skew_ms, sim.config.decision_clock_skew_ms)

    def decide_by_ms(self) -> int:
        """A submit's decision deadline: the margin before this edge stops waiting, on its deadline clock."""
        config = self.sim.config
        return self.sim.now_ms + self.deadline_clock_skew_ms + config.edge_timeout_ms - config.edge_decision_margin_ms

    def reply_to(self) -> tuple[str, cmd.ReplyTo]:
        request_id = self.sim.new_id("edge:r")
        return request_id, cmd.ReplyTo(topic=self.sim.topology.edge_inbox.name, partition=0, request_id=request_id)

    def new_request(self, user: str) -> None:
        sim, config = self.sim, self.sim.config
        if sim.draining:
            return
        sim.at(sim.between(config.request_gap_ms), self.new_request, user)
        if sim.rng.random() < config.conversation_p:
            self.conversation_request(user)
            return
        earlier = self.history[user]
        roll = sim.rng.random()
        if earlier and roll < config.conflict_p:
            old = sim.rng.choice(earlier)
            request = Request(user, old.key, old.fingerprint + "-x", old.tier, old.max_output_tokens)
        elif earlier and roll < config.conflict_p + config.reuse_p:
            old = sim.rng.choice(earlier)
            request = Request(user, old.key, old.fingerprint, old.tier, old.max_output_tokens)
        else:
            key = sim.new_id(f"{user}-key")
            tier = Tier.PAID if sim.rng.random() < 0.1 else Tier.FREE
            request = Request(user, key, f"fp-{key}-{sim.rng.randrange(10**6)}", tier, sim.rng.choice((16, 64, 256)))
            earlier.append(request)
            if len(earlier) > 50:
                earlier.pop(0)
        self.submit(request)

    def conversation_request(self, user: str) -> None:
        """Create, delete, or a turn (maybe a regeneration, maybe at a stale revision) in a conversation."""
        sim = self.sim
        mine = self.conversations[user]
        roll = sim.rng.random()
        if len(mine) < 2 or roll < 0.05:
            cid = sim.new_id(f"conv-{user}")
            mine[cid] = 0
            request_id, reply_to = self.reply_to()
            self.pending[request_id] = ("create", Request(user, cid, "", Tier.FREE, 0, conversation_id=cid))
            sim.append_command(
                cmd.CreateConversation(
                    command_id=sim.new_id(f"create:{user}"), user_id=user, issued_at_ms=sim.now_ms + self.clock_skew_ms,
                    conversation_id=cid, reply_to=reply_to,
                )
            )
            return
        cid = sim.rng.choice(sorted(mine))
        if roll < 0.08:
            del mine[cid]
            request_id, reply_to = self.reply_to()
            sim.append_command(
                cmd.DeleteConversation(
                    command_id=sim.new_id(f"delete:{user}"), user_id=user, issued_at_ms=sim.now_ms + self.clock_skew_ms,
                    conversation_id=cid, restore_revision=sim.parked.get(cid, -1), reply_to=reply_to,
                )
            )
            return
        revision = mine[cid]
        if sim.rng.random() < sim.config.stale_revision_p:
            revision = max(0, revision - sim.rng.randint(1, 2))  # a second device that has not caught up
        regenerate = revision >= 2 and sim.rng.random() < 0.15
        key = sim.new_id(f"{user}-turn")
        request = Request(
            user, key, f"fp-{key}", Tier.FREE, sim.rng.choice((16, 64)),
            conversation_id=cid, expected_revision=revision, regenerate=regenerate,
        )
        self.submit(request)

    def submit(self, request: Request) -> None:
        sim = self.sim
        request.tries += 1
        request_id, reply_to = self.reply_to()
        self.fingerprints[(request.user, request.key)].add(request.fingerprint)
        command = cmd.SubmitGeneration(
            command_id=sim.new_id(f"submit:{request.user}"),
            user_id=request.user,
            issued_at_ms=sim.now_ms + self.clock_skew_ms,
            idempotency_key=request.key,
            fingerprint=request.fingerprint,
            model_alias=MODEL_ALIAS,
            tier=request.tier,
            stream=True,
            max_output_tokens=request.max_output_tokens,
            input_tokens=sim.rng.randint(1, 500),
            estimated_queue_wait_ms=5_000 if sim.rng.random() < 0.03 else 0,
            decide_by_ms=self.decide_by_ms(),
            reader_id=READER_ID,
            reply_to=reply_to,
            conversation_id=request.conversation_id,
            expected_revision=request.expected_revision,
            regenerate=request.regenerate,
            restore_revision=sim.parked.get(request.conversation_id, -1) if request.conversation_id else -1,
        )
        self.pending[request_id] = ("submit", request)
        sim.append_command(command)
        sim.at(sim.config.edge_timeout_ms, self.timeout, request_id)

    def cancel(self, request: Request) -> None:
        sim = self.sim
        if request.generation_id is None or sim.draining:
            return
        if request.cancel_tries == 0 and sim.rng.random() < DETACH_P:
            self.detach(request)
            return
        request.cancel_tries += 1
        request_id, reply_to = self.reply_to()
        reason = sim.rng.choice((CancelReason.USER, CancelReason.CLIENT_DISCONNECT))
        command = cmd.CancelGeneration(
            command_id=sim.new_id(f"cancel:{request.user}"),
            user_id=request.user,
            issued_at_ms=sim.now_ms + self.clock_skew_ms,
            generation_id=request.generation_id,
            reason=reason,
            reply_to=reply_to,
        )
        self.pending[request_id] = ("cancel", request)
        sim.append_command(command)
        sim.at(sim.config.edge_timeout_ms, self.timeout, request_id)

    def detach(self, request: Request) -> None:
        """The client goes away: its generation is detached (a lost command is a lost detach: the
        generation then ends by its own deadlines); sometimes a reader comes back within the grace."""
        sim = self.sim
        assert request.generation_id is not None
        request.cancel_tries += 1
        grace_ms = sim.rng.randint(0, DETACH_GRACE_MS_MAX)
        sim.stats.detaches += 1
        sim.append_command(
            cmd.DetachReader(
                command_id=sim.new_id(f"detach:{request.user}"),
                user_id=request.user,
                issued_at_ms=sim.now_ms + self.clock_skew_ms,
                generation_id=request.generation_id,
                reader_id=READER_ID,
                grace_ms=grace_ms,
                reason=sim.rng.choice((CancelReason.CLIENT_DISCONNECT, CancelReason.EDGE_LOST)),
            )
        )
        if sim.rng.random() < REATTACH_P:
            sim.at(sim.rng.randint(0, 2 * grace_ms + 1), self.attach, request)

    def attach(self, request: Request) -> None:
        sim = self.sim
        if request.generation_id is None or sim.draining:
            return
        sim.stats.attaches += 1
        sim.append_command(
            cmd.AttachReader(
                command_id=sim.new_id(f"attach:{request.user}"),
                user_id=request.user,
                issued_at_ms=sim.now_ms + self.clock_skew_ms,
                generation_id=request.generation_id,
                reader_id=f"{READER_ID}-again",
            )
        )

    def timeout(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is None or self.sim.draining:
            return
        self.sim.stats.edge_timeouts += 1
        kind, request = entry
        # No answer in time: the client saw 503 and retries with the same key. A submit read after its
        # deadline holds nothing; one decided in time whose answer was lost is found by the retry.
        self.retry(kind, request)

    def retry(self, kind: str, request: Request) -> None:
        if kind == "submit" and request.tries < self.sim.config.edge_retries_max:
            self.sim.at(self.sim.between((50, 1_000)), self.submit, request)
        elif kind == "cancel" and request.cancel_tries < self.sim.config.edge_retries_max:
            self.sim.at(self.sim.between((50, 1_000)), self.cancel, request)

    def on_outcome(self, outcome: Outcome) -> None:
        entry = self.pending.pop(outcome.request_id or "", None)
        if entry is None:
            return  # a duplicate, or a late answer to a request that already timed out
        kind, request = entry
        sim = self.sim
        if kind == "create":
            if outcome.code is RejectionCode.NOT_FOUND or outcome.code is RejectionCode.RATE_LIMITED:
                self.conversations[request.user].pop(request.conversation_id, None)
            return
        if request.conversation_id:
            mine = self.conversations[request.user]
            if outcome.code is RejectionCode.CONVERSATION_CONFLICT and outcome.details.revision is not None:
                if request.conversation_id in mine:
                    mine[request.conversation_id] = outcome.details.revision
            elif outcome.code is RejectionCode.NOT_FOUND:
                mine.pop(request.conversation_id, None)
        if kind == "cancel":
            if outcome.kind is OutcomeKind.CANCEL_REQUESTED and sim.rng.random() < 0.3:
                sim.at(sim.between((500, 3_000)), self.cancel, request)  # the impatient second click
            return
        code = outcome.code
        if code is RejectionCode.IDEMPOTENCY_CONFLICT:
            if len(self.fingerprints[(request.user, request.key)]) < 2:
                sim.fail(f"idempotency_conflict for {request.user}/{request.key}, never sent with other content")
            return
        if outcome.kind is OutcomeKind.ADMITTED or code is RejectionCode.GENERATION_IN_PROGRESS:
            if outcome.generation_id is None:
                sim.fail(f"{outcome.kind} without a generation id")
            request.generation_id = outcome.generation_id
            self.by_generation[outcome.generation_id] = request
            if sim.rng.random() < sim.config.cancel_p:
                sim.at(sim.between((0, 6_000)), self.cancel, request)
        elif code is RejectionCode.QUOTA_SERVICE_UNAVAILABLE:
            self.retry(kind, request)  # read after its deadline: the edge answers 503, as on a timeout
        elif code is RejectionCode.IDEMPOTENCY_KEYS_EXHAUSTED:
            # Nothing was recorded, so a same-key retry after the delay is decided afresh. Only some
            # clients retry: every refused request of the user is told the same moment.
            if request.admission_retries == 0 and sim.rng.random() < 0.3:
                request.admission_retries += 1
                request.tries = 0
                wait = outcome.details.retry_after_ms or 1_000
                sim.at(wait + sim.between((0, 30_000)), self.submit, request)
        elif code in (RejectionCode.CONCURRENCY_LIMITED, RejectionCode.CAPACITY_EXHAUSTED):
            if request.admission_retries < 3:
                request.admission_retries += 1
                request.tries = 0
                wait = outcome.details.retry_after_ms or 1_000
                sim.at(wait + sim.between((0, 1_000)), self.submit, request)

    def on_finalized(self, message: GenerationFinalized) -> None:
        request = self.by_generation.get(message.generation_id)
        sim = self.sim
        if request is None or sim.draining:
            return
        if request.conversation_id:
            # The answer committed: the next turn goes after it (the client learns the revision here).
            mine = self.conversations[request.user]
            if request.conversation_id in mine:
                base = request.expected_revision if request.regenerate else request.expected_revision + 1
                mine[request.conversation_id] = max(mine[request.conversation_id], base + 1)
            return
        if message.status is RequestStatus.ADMISSION_RETRYABLE and sim.rng.random() < 0.7:
            # Proven never started: the client's retry reserves afresh under the same key.
            request.tries = 0
            sim.at(sim.between((100, 2_000)), self.submit, request)
