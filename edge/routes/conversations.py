"""``/v1/conversations``: create, list, read, read messages, delete (docs/conversations.md).

Authority: a conversation's existence, committed revision and deletion are decided by the caller's
ledger in the processor (``CreateConversation`` / ``DeleteConversation`` on the caller's partition);
titles and messages are read from Cassandra (``infra.stores.history``) through ``edge.history``.
Another user's conversation, an unknown one and a deleted one answer the same ``404 not_found``.
A store failure is ``503 history_unavailable`` (retryable, Retry-After); stateless generations go on.

Consistency: a conversation's own reads (``GET /{id}``, ``/{id}/messages``) show what the history
writer has stored, which trails the ledger by milliseconds; a turn never builds its context around a
revision the store has not caught up with (edge/history.py). The sidebar list
(``GET /v1/conversations``) is eventually consistent: a new conversation appears once created
(the edge writes its index row before answering 201), a reordering by activity once the writer
stored the turn.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from control_plane.ids import conversation_id_for
from edge.deps import CurrentPrincipal, EdgeDep, IdempotencyKey
from edge.errors import ApiError
from edge.history import owned_conversation
from edge.routes.generations import _ERRORS, STRICT_PARSING_NOTE, _STRICT, read_body, validated
from infra.runtime.command_client import DecisionTimeout, TooManyPending
from infra.stores.history import BucketBudget
from schemas.codes import RejectionCode
from schemas.commands import CreateConversation, DeleteConversation
from schemas.messages import Outcome, OutcomeKind

router = APIRouter(prefix="/v1/conversations", tags=["conversations"])

TITLE_CHARS_MAX = 200
CREATE_BODY_BYTES_MAX = 4 * 1024
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 20, 100
MESSAGES_LIMIT_DEFAULT, MESSAGES_LIMIT_MAX = 50, 200
# Superseded answers skipped while reading one page of the active branch: the store is asked again
# at most this many times for what they took (a conversation regenerated over and over still costs
# a bounded number of reads per page; the page is then short, and ``next_after`` goes on from it).
MESSAGES_REFILLS_MAX = 4
# ``messages`` partitions one messages read may query, whatever its cursor and refills: a page of the
# largest limit over dense seqs needs ceil(200 / 64) + 1 = 5. Past it the page is short and
# ``next_after`` goes on from it, so no cursor can make a read cost more than this.
MESSAGES_BUCKETS_PER_READ_MAX = 8

ConversationId = Annotated[str, Path(min_length=1, max_length=64)]


class CreateConversationRequest(BaseModel):
    model_config = ConfigDict(**_STRICT, json_schema_extra={"description": STRICT_PARSING_NOTE})
    title: str | None = Field(default=None, min_length=1, max_length=TITLE_CHARS_MAX)


class ConversationDocument(BaseModel):
    id: str
    title: str | None
    revision: int
    created_at: str
    updated_at: str


class ConversationList(BaseModel):
    data: list[ConversationDocument]
    next_cursor: str | None


class MessageDocument(BaseModel):
    seq: int
    id: str
    role: str
    content: str
    status: str
    generation_id: str
    created_at: str
    # An answer: the user turn it answers. A regenerated answer and the one it replaced share it
    # (siblings); only the newest is on the active branch, the others carry ``superseded_by``.
    parent_seq: int | None = None
    superseded_by: int | None = None


class MessagePage(BaseModel):
    data: list[MessageDocument]
    next_after: int | None
    revision: int


def iso_utc_ms(ms: int) -> str:
    """ISO-8601 UTC to the millisecond: a conversation's ``updated_at`` moves with every turn, and
    turns follow each other within a second (whole seconds would show two turns at one time)."""
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _conversation_doc(row: Any) -> dict[str, Any]:
    return {
        "id": row.conversation_id,
        "title": row.title,
        "revision": row.revision,
        "created_at": iso_utc_ms(row.created_at_ms),
        "updated_at": iso_utc_ms(row.updated_at_ms),
    }


def _message_doc(m: Any) -> dict[str, Any]:
    doc = {
        "seq": m.seq,
        "id": f"msg_{m.conversation_id.removeprefix('conv_')}_{m.seq}",
        "role": m.role,
        "content": m.content,
        "status": m.status,
        "generation_id": m.generation_id,
        "created_at": iso_utc_ms(m.created_at_ms),
    }
    if m.role == "assistant":
        doc["parent_seq"] = m.parent_seq
        doc["superseded_by"] = m.superseded_by
    return doc


async def _decide(edge: Any, command: Any) -> Outcome:
    try:
        return await edge.client.decide(command, timeout_s=edge.settings.decision_timeout_s)
    except (DecisionTimeout, TooManyPending):
        raise ApiError(RejectionCode.QUOTA_SERVICE_UNAVAILABLE) from None


def _now_ms() -> int:
    return int(time.time() * 1000)


@router.post(
    "",
    status_code=201,
    summary="Create a conversation (Idempotency-Key: a same-key retry returns the same conversation)",
    response_model=ConversationDocument,
    responses=_ERRORS,
)
async def create_conversation(
    request: Request, principal: CurrentPrincipal, key: IdempotencyKey, edge: EdgeDep
) -> Response:
    body = await read_body(request, CREATE_BODY_BYTES_MAX)
    req = validated(_json(body), CreateConversationRequest)
    cid = conversation_id_for(principal.user_id, key)
    history = edge.history
    row = await history.get_conversation(cid)
    if row is not None and row.user_id != principal.user_id:
        raise ApiError(RejectionCode.NOT_FOUND)  # cannot happen (the id is derived from the user)
    if row is not None and row.title != req.title:
        raise ApiError(RejectionCode.IDEMPOTENCY_CONFLICT)
    if row is not None and row.status == "deleted":
        raise ApiError(RejectionCode.NOT_FOUND)
    if row is not None and row.status == "active":
        return JSONResponse(_conversation_doc(row), status_code=201, headers={"Cache-Control": "no-store"})
    created_at_ms = row.created_at_ms if row is not None else _now_ms()
    if row is None:
        # The title first (the ledger never holds it); a refused create leaves an unconfirmed row,
        # which every read ignores.
        await history.put_conversation(cid, principal.user_id, req.title, created_at_ms)
    outcome = await _decide(
        edge,
        CreateConversation(
            command_id=uuid.uuid4().hex, user_id=principal.user_id, issued_at_ms=_now_ms(), conversation_id=cid,
            reply_to=edge.client.reply_to(request.state.request_id),
        ),
    )
    if outcome.kind is OutcomeKind.REJECTED:
        raise ApiError(outcome.code or RejectionCode.NOT_FOUND, outcome.details)
    # Confirmed here too (the history writer does the same from the ledger), so the 201 is followed
    # by reads and a list that show it.
    await history.confirm_conversation(cid, principal.user_id, created_at_ms)
    doc = {
        "id": cid,
        "title": req.title,
        "revision": outcome.revision or 0,
        "created_at": iso_utc_ms(created_at_ms),
        "updated_at": iso_utc_ms(created_at_ms),
    }
    return JSONResponse(doc, status_code=201, headers={"Cache-Control": "no-store"})


def _json(body: bytes) -> Any:
    import orjson

    if not body.strip():
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="body") from None


@router.get("", summary="The caller's conversations, most recently updated first", response_model=ConversationList, responses=_ERRORS)
async def list_conversations(
    principal: CurrentPrincipal,
    edge: EdgeDep,
    limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX)] = LIST_LIMIT_DEFAULT,
    cursor: Annotated[str | None, Query(min_length=1, max_length=512)] = None,
) -> Response:
    try:
        rows, next_cursor = await edge.history.list_conversations(principal.user_id, limit, cursor)
    except ValueError:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="cursor") from None
    doc = {"data": [_conversation_doc(r) for r in rows], "next_cursor": next_cursor}
    return JSONResponse(doc, headers={"Cache-Control": "no-store"})


@router.get("/{conversation_id}", summary="A conversation's metadata and committed revision", response_model=ConversationDocument, responses=_ERRORS)
async def get_conversation(principal: CurrentPrincipal, conversation_id: ConversationId, edge: EdgeDep) -> Response:
    row = await owned_conversation(edge.history, conversation_id, principal.user_id)
    return JSONResponse(_conversation_doc(row), headers={"Cache-Control": "no-store"})


@router.get(
    "/{conversation_id}/messages",
    summary="A bounded range of the active branch: ascending after a seq, or newest first before one",
    description=(
        "Cursors past the end read what exists (before is clamped to revision + 1, after to revision). One read "
        f"queries at most {MESSAGES_BUCKETS_PER_READ_MAX} storage buckets; a page cut short by that bound has a "
        "next_after to page on from."
    ),
    response_model=MessagePage,
    responses=_ERRORS,
)
async def read_messages(
    principal: CurrentPrincipal,
    conversation_id: ConversationId,
    edge: EdgeDep,
    after: Annotated[int | None, Query(ge=0)] = None,
    before: Annotated[int | None, Query(ge=1)] = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "asc",
    limit: Annotated[int, Query(ge=1, le=MESSAGES_LIMIT_MAX)] = MESSAGES_LIMIT_DEFAULT,
    branch: Annotated[str, Query(pattern="^(active|all)$")] = "active",
) -> Response:
    history = edge.history
    row = await owned_conversation(history, conversation_id, principal.user_id)
    if before is not None and after is not None:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="before")
    descending = order == "desc" or before is not None
    if descending and after is not None:
        raise ApiError(RejectionCode.INVALID_REQUEST, field="order")
    # Only committed messages: those the ledger's verdict reached (an answer is written before its
    # commit, without a status, and shown once committed).
    page: list[Any] = []
    # Cursors are clamped to what exists (seqs are the revisions 1..revision): a cursor past the end
    # reads the newest page (descending) or nothing (ascending), never the empty buckets beyond.
    newest = row.revision + 1
    cursor = min(before if before is not None else newest, newest) if descending else min(after or 0, row.revision)
    budget = BucketBudget(MESSAGES_BUCKETS_PER_READ_MAX)
    last_seen: int | None = None
    for _ in range(MESSAGES_REFILLS_MAX):
        wanted = limit - len(page)
        if descending:
            rows = await history.read_before(conversation_id, cursor, wanted, budget=budget)
        else:
            rows = await history.read_after(conversation_id, cursor, wanted, row.revision, budget=budget)
        for m in rows:
            last_seen = m.seq
            if m.status is None or (branch == "active" and m.superseded_by is not None):
                continue
            page.append(m)
        if len(rows) < wanted or len(page) >= limit:
            # A read cut short by the bucket budget is not the end: the client pages on from it.
            exhausted = len(rows) < wanted and not budget.ran_out
            break
        cursor = rows[-1].seq
    else:
        exhausted = False
    next_after = None if exhausted or last_seen is None else last_seen
    doc = {"data": [_message_doc(m) for m in page], "next_after": next_after, "revision": row.revision}
    return JSONResponse(doc, headers={"Cache-Control": "no-store"})


@router.delete("/{conversation_id}", status_code=204, summary="Delete a conversation and every message of it (idempotent)", responses=_ERRORS)
async def delete_conversation(
    request: Request, principal: CurrentPrincipal, conversation_id: ConversationId, edge: EdgeDep
) -> Response:
    history = edge.history
    row = await history.get_conversation(conversation_id)
    if row is not None and row.user_id != principal.user_id:
        raise ApiError(RejectionCode.NOT_FOUND)
    restore = row.parked_revision if row is not None and row.parked_revision is not None else -1
    outcome = await _decide(
        edge,
        DeleteConversation(
            command_id=uuid.uuid4().hex, user_id=principal.user_id, issued_at_ms=_now_ms(),
            conversation_id=conversation_id, restore_revision=restore,
            reply_to=edge.client.reply_to(request.state.request_id),
        ),
    )
    if outcome.kind is OutcomeKind.REJECTED:
        raise ApiError(outcome.code or RejectionCode.NOT_FOUND, outcome.details)
    if row is not None and row.status != "deleted":
        # Reads answer 404 from now on; the history writer removes every row (messages, index,
        # results of its generations) from the ledger's ConversationDeleted.
        await history.mark_deleted(conversation_id)
    return Response(status_code=204)
