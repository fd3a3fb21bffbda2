"""Closed vocabularies shared by every component: tiers, statuses, outcomes and the error table.

``REJECTIONS`` is the seed's error table (section 5) in one place: the edge maps a
``RejectionCode`` to HTTP through it and nowhere else, and the core returns these codes as data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Tier(StrEnum):
    FREE = "free"
    PAID = "paid"


class RequestStatus(StrEnum):
    """Status of one logical request ``(user_id, idempotency_key)``."""

    ADMISSION_RETRYABLE = "admission_retryable"  # holds nothing; a same-key retry re-admits it
    QUEUED = "queued"  # reservation RESERVED, slot held, dispatched, not accepted
    RUNNING = "running"  # accepted: reservation CONSUMED
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    REJECTED = "rejected"  # refused for good (quota); the key keeps identifying that refusal

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def active(self) -> bool:
        return self is RequestStatus.QUEUED or self is RequestStatus.RUNNING


_TERMINAL = frozenset(
    {RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED, RequestStatus.REJECTED}
)


class ReservationState(StrEnum):
    RESERVED = "reserved"
    CONSUMED = "consumed"
    RELEASED = "released"


class FinishOutcome(StrEnum):
    """How a worker says an attempt ended (finish reasons are a closed set)."""

    COMPLETED = "completed"  # stop token or max_output_tokens reached
    STOPPED = "stopped"  # the engine acknowledged a stop after a cancel
    FAILED = "failed"  # engine error, crash detected, or the worker enforced a deadline


class FinishReason(StrEnum):
    """Why an attempt ended, as its worker reports it (``ReportAttemptFinished.finish_reason``).

    The ledger keeps it in ``GenerationCompleted.finish_reason`` (completions) and, when not empty, in
    ``UsageRecorded.terminal_reason``. Closed: a worker sends nothing else (an engine's own error text
    stays in the worker's log as ``engine_error``). An engine's ``Finished.reason``
    (``workers.engines.base``) is one of STOP, LENGTH and ABORTED."""

    NONE = ""  # no reason given (the command's default; recorded ledgers carry it)
    # The engine ended the answer by itself.
    STOP = "stop"  # the model ended its answer
    LENGTH = "length"  # max_output_tokens reached
    # The engine acknowledged a stop; why the worker stopped it.
    ABORTED = "aborted"  # an abort the worker did not ask for
    CANCEL = "cancel"  # the generation was cancelled
    FENCED = "fenced"  # the processor fenced the epoch
    LEASE_LOST = "lease_lost"  # no lease renewal was confirmed in time
    WORKER_SHUTDOWN = "worker_shutdown"  # the worker's drain on shutdown ran out
    # The worker ended the attempt without the engine's end.
    GENERATION_DURATION_MAX = "generation_duration_max"  # the run passed the worker's duration limit
    ENGINE_STALLED = "engine_stalled"  # the engine produced nothing for too long
    ABORT_NOT_ACKNOWLEDGED = "abort_not_acknowledged"  # the engine never acknowledged the abort
    ENGINE_ENDED_WITHOUT_FINISH = "engine_ended_without_finish"  # the engine's stream ended without its end
    ENGINE_ERROR = "engine_error"  # the engine failed (its reason stays in the worker's log)
    # The worker's output check (infra/content/policy_checks.py) refused the text: stopped.
    OUTPUT_REFUSED = "output_refused"


class CancelReason(StrEnum):
    USER = "user"
    CLIENT_DISCONNECT = "client_disconnect"
    SLOW_CONSUMER = "slow_consumer"
    DRAIN = "drain"
    # The edge that held the generation's reader stopped renewing its liveness lease (it died) and no
    # reader reattached within the detach grace (DetachReader, issued by the processor's shell).
    EDGE_LOST = "edge_lost"


class FenceReason(StrEnum):
    CANCELLED_IN_QUEUE = "cancelled_in_queue"
    DECLINED = "declined"
    QUEUE_DEADLINE = "queue_deadline"
    LEASE_EXPIRED = "lease_expired"
    RUN_DEADLINE = "run_deadline"


class TerminalReason(StrEnum):
    """Why an attempt's usage was settled (``UsageRecorded.terminal_reason``).

    A worker's report records its ``FinishReason`` when not empty, else its ``FinishOutcome``; an
    attempt whose report is lost (the processor fenced it at a deadline) records the ``FenceReason``.
    The values are those names' own, so a record written before this enum decodes unchanged."""

    # The worker's FinishReason (not empty).
    STOP = "stop"
    LENGTH = "length"
    ABORTED = "aborted"
    CANCEL = "cancel"
    FENCED = "fenced"
    LEASE_LOST = "lease_lost"
    WORKER_SHUTDOWN = "worker_shutdown"
    GENERATION_DURATION_MAX = "generation_duration_max"
    ENGINE_STALLED = "engine_stalled"
    ABORT_NOT_ACKNOWLEDGED = "abort_not_acknowledged"
    ENGINE_ENDED_WITHOUT_FINISH = "engine_ended_without_finish"
    ENGINE_ERROR = "engine_error"
    OUTPUT_REFUSED = "output_refused"
    # The worker's FinishOutcome, for a report with no finish reason.
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"
    # The processor's FenceReason for a running attempt whose report never came.
    LEASE_EXPIRED = "lease_expired"
    RUN_DEADLINE = "run_deadline"


_TERMINAL_REASONS = {r.value for r in TerminalReason}
assert {r.value for r in FinishReason if r is not FinishReason.NONE} <= _TERMINAL_REASONS, "every finish reason settles"
assert {r.value for r in FinishOutcome} <= _TERMINAL_REASONS, "every outcome settles"
assert {FenceReason.LEASE_EXPIRED.value, FenceReason.RUN_DEADLINE.value} <= _TERMINAL_REASONS, "every lost report settles"


class LateReportReason(StrEnum):
    """Why a worker's command was dropped (``LateReportIgnored.reason``)."""

    OWNED_ELSEWHERE = "owned_elsewhere"  # another worker accepted the attempt first
    FENCED_EPOCH = "fenced_epoch"  # the command's epoch is fenced
    TERMINAL = "terminal"  # the generation already ended
    STALE_EPOCH = "stale_epoch"  # the command names an epoch other than the current one
    NOT_CURRENT_OWNER = "not_current_owner"  # the current epoch, but another worker (or none) owns it


class AnswerStatus(StrEnum):
    """How a conversation turn's generation ended, for its answer (``ConversationAnswerPending.status``,
    ``ConversationAnswerCommitted.status``)."""

    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # cancelled, failed, or never started


class SlotReleaseReason(StrEnum):
    """Why a concurrency slot was freed; the only allowed ones (invariant 6)."""

    STOP_ACKNOWLEDGED = "stop_acknowledged"  # the worker reported the attempt ended
    NEVER_ACCEPTED = "never_accepted"  # fenced before acceptance: cannot have started
    LEASE_FENCED = "lease_fenced"  # the lease lapsed and the epoch is fenced


class RetryAttach(StrEnum):
    """How a submit without a client's ``Idempotency-Key`` may be answered by a generation already
    admitted for the same request (the OpenAI-compatible route; docs/edge.md, "Retries without a key").

    The edge makes up a fresh key for each such try, so the key cannot tie a client's automatic
    retries to the first try; the processor matches them by fingerprint instead, in the admission
    decision itself.
    """

    OFF = "off"  # the client's own key identifies the request: no fingerprint matching
    # A keyless first try: admitted as a new request and remembered by fingerprint for the attach
    # window; it attaches only to a generation one of its own retries was admitted as before it.
    ORIGINAL = "original"
    # A keyless try the client marked as its retry: attaches to the newest running or completed
    # generation of the same fingerprint remembered within the window; without one it is admitted.
    RETRY = "retry"


class ClientAction(StrEnum):
    FIX_REQUEST = "fix_request"
    AUTHENTICATE = "authenticate"
    CHANGE_REQUEST = "change_request"
    USE_NEW_KEY = "use_new_key"
    INSPECT_GENERATION = "inspect_generation"
    REGENERATE_EXPLICITLY = "regenerate_explicitly"
    WAIT_FOR_RESET = "wait_for_reset"
    RETRY_AFTER_DELAY = "retry_after_delay"
    RETRY_SAME_KEY_WITH_BACKOFF = "retry_same_key_with_backoff"
    RETRY_LATER_NO_STORM = "retry_later_no_storm"
    MANUAL_REGENERATE = "manual_regenerate"
    RELOAD_CONVERSATION = "reload_conversation"
    NONE = "none"


class RateLimitScope(StrEnum):
    """Which burst bucket refused a ``rate_limited`` answer (its ``details.scope``; docs/edge.md)."""

    USER = "user"  # the principal's bucket (after authentication)
    IP = "ip"  # the client address's bucket (before authentication: edge/client_ip.py)
    # The page's first-token beacon's own bucket (POST /v1/client-metrics): never the user's generation bucket.
    CLIENT_METRICS = "client_metrics"


class RejectionCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    GENERATION_IN_PROGRESS = "generation_in_progress"
    RESULT_UNAVAILABLE = "result_unavailable"
    # The generation completed, but the worker's result sink had not stored its text when it reported
    # (a slow or unreachable result store: the text is held for a later write). Retry shortly; after
    # the read model's pending window it answers result_unavailable like an expired result.
    RESULT_PENDING = "result_pending"
    QUOTA_EXHAUSTED = "quota_exhausted"
    RATE_LIMITED = "rate_limited"
    CONCURRENCY_LIMITED = "concurrency_limited"
    # A new key while the user's request records are all still within their dedup retention (the
    # core keeps every key it answered for its whole retention, so it refuses a new one instead).
    IDEMPOTENCY_KEYS_EXHAUSTED = "idempotency_keys_exhausted"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    # The admission authority (the processor) gave no decision in time: for admission only.
    QUOTA_SERVICE_UNAVAILABLE = "quota_service_unavailable"
    # A store the edge reads (the Cassandra read model, the stored deltas of resumable streams) did not
    # answer in time; nothing was decided or charged. Apart from admission, so dashboards tell them apart.
    STORE_UNAVAILABLE = "store_unavailable"
    # A bug in the edge (an unhandled exception), answered typed; counted in chatplane_edge_unhandled_errors_total.
    INTERNAL_ERROR = "internal_error"
    MODEL_BACKEND_ERROR = "model_backend_error"
    GENERATION_TIMEOUT = "generation_timeout"
    # Conversations (docs/conversations.md): a turn sent against a revision that is no longer the
    # committed one, and the history store (Cassandra) unreachable for a conversation read or turn.
    CONVERSATION_CONFLICT = "conversation_conflict"
    HISTORY_UNAVAILABLE = "history_unavailable"
    # Policy checks at their boundaries (docs/policy.md): the edge's prompt check refused the request
    # before admission (nothing reserved), or the worker's output check stopped the generation.
    PROMPT_REFUSED = "prompt_refused"
    OUTPUT_REFUSED = "output_refused"
    # Not in the client table: answers to workers and to look-ups of unknown ids.
    NOT_FOUND = "not_found"
    STALE_ATTEMPT = "stale_attempt"


@dataclass(frozen=True, slots=True)
class RejectionSpec:
    code: RejectionCode
    http_status: int
    retryable: bool
    action: ClientAction
    message: str


def _spec(code: RejectionCode, status: int, retryable: bool, action: ClientAction, message: str) -> RejectionSpec:
    return RejectionSpec(code, status, retryable, action, message)


_C, _A = RejectionCode, ClientAction

# The seed's section 5 table. ``retryable`` means "an automatic retry may succeed"; for
# quota_exhausted it is false because no automatic retry succeeds in the current window.
REJECTIONS: dict[RejectionCode, RejectionSpec] = {
    s.code: s
    for s in (
        _spec(_C.INVALID_REQUEST, 400, False, _A.FIX_REQUEST, "The request is invalid; fix it before retrying."),
        _spec(_C.UNAUTHORIZED, 401, False, _A.AUTHENTICATE, "Authentication is required."),
        _spec(_C.MODEL_NOT_ALLOWED, 403, False, _A.CHANGE_REQUEST, "This model is not available to your account."),
        _spec(_C.IDEMPOTENCY_CONFLICT, 409, False, _A.USE_NEW_KEY, "This Idempotency-Key was used with different content."),
        _spec(_C.GENERATION_IN_PROGRESS, 409, False, _A.INSPECT_GENERATION, "A generation for this request is already in progress."),
        _spec(_C.RESULT_UNAVAILABLE, 410, False, _A.REGENERATE_EXPLICITLY, "The generation's content has expired."),
        _spec(_C.RESULT_PENDING, 503, True, _A.RETRY_AFTER_DELAY, "The generation completed; its text is not stored yet. Retry shortly."),
        _spec(_C.QUOTA_EXHAUSTED, 429, False, _A.WAIT_FOR_RESET, "Your current message allowance has been used."),
        _spec(_C.RATE_LIMITED, 429, True, _A.RETRY_AFTER_DELAY, "Too many requests; wait before retrying."),
        _spec(_C.CONCURRENCY_LIMITED, 429, True, _A.RETRY_AFTER_DELAY, "Too many active generations; wait for one to finish."),
        _spec(_C.IDEMPOTENCY_KEYS_EXHAUSTED, 429, True, _A.RETRY_AFTER_DELAY, "Too many new Idempotency-Keys in the retention period; wait before retrying."),
        _spec(_C.CAPACITY_EXHAUSTED, 503, True, _A.RETRY_SAME_KEY_WITH_BACKOFF, "No model capacity is available right now."),
        _spec(_C.QUOTA_SERVICE_UNAVAILABLE, 503, True, _A.RETRY_LATER_NO_STORM, "Admission is temporarily unavailable."),
        _spec(_C.STORE_UNAVAILABLE, 503, True, _A.RETRY_AFTER_DELAY, "A data store is temporarily unavailable; nothing was changed. Retry shortly."),
        _spec(_C.INTERNAL_ERROR, 500, True, _A.RETRY_LATER_NO_STORM, "An internal error occurred; it is logged under this request_id. Retry later."),
        _spec(_C.MODEL_BACKEND_ERROR, 502, False, _A.MANUAL_REGENERATE, "The model backend failed; inspect the generation."),
        _spec(_C.GENERATION_TIMEOUT, 504, False, _A.MANUAL_REGENERATE, "The generation ran past its deadline; inspect the generation."),
        _spec(_C.CONVERSATION_CONFLICT, 409, False, _A.RELOAD_CONVERSATION, "The conversation changed since the revision you sent; reload it and send again."),
        _spec(_C.HISTORY_UNAVAILABLE, 503, True, _A.RETRY_AFTER_DELAY, "Conversation history is temporarily unavailable; stateless requests still work."),
        _spec(_C.PROMPT_REFUSED, 400, False, _A.CHANGE_REQUEST, "The request was refused by a content policy; change it before sending again."),
        _spec(_C.OUTPUT_REFUSED, 422, False, _A.CHANGE_REQUEST, "The answer was stopped by a content policy; change the request before sending again."),
        _spec(_C.NOT_FOUND, 404, False, _A.NONE, "Not found."),
        _spec(_C.STALE_ATTEMPT, 409, False, _A.NONE, "The attempt is fenced, stale or owned elsewhere."),
    )
}
assert set(REJECTIONS) == set(RejectionCode), "every code needs a row"
