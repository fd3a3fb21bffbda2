"""A conversation turn's context, built by tokens: the newest history that fits the model's window.

Where it sits in the data flow::

    POST a conversation turn (edge route)
        |-- build_context(model, before_seq, read_page, new_turn, max_output_tokens)
        |       budget = model.context_tokens - max_output_tokens
        |       count_system_tokens(model) + the new turn          -> TurnTooLarge when over budget
        |       read_page(before, CONTEXT_PAGE_SIZE), newest first  -> whole messages while they fit
        `-- BuiltContext.messages   -> the prompt the engine sees (system instructions added by the worker)
            BuiltContext.input_tokens -> the command's input_tokens (quota and token budgets)

``input_tokens`` is the model tokenizer's count of exactly ``messages`` (with the trusted system
instructions and the per-message framing): it equals ``count_input_tokens(model, messages)``
because it is the sum of the same two terms, ``count_system_tokens`` and ``count_message_tokens``.

The context is a contiguous suffix of the history: messages are added newest first and the build
stops at the first one that does not fit (an older, shorter one is never squeezed in past it, so the
model never sees a conversation with a hole in it). History is read in bounded pages, newest first,
and reading stops as soon as the budget is full, so a build costs O(budget), not O(conversation
length); ``CONTEXT_PAGES_MAX`` bounds it even for a history of tiny messages.

Regenerate (``new_turn=None``): the caller passes ``history_before_seq`` just above the user message
to answer again (the seq of the answer being replaced, or the user message's seq + 1). The newest
history item before it must be that user message (``NoTurnToRegenerate`` otherwise); it is the turn,
it must fit like a new turn would (``TurnTooLarge``), and the history before it fills the rest.

Over the history store, ``history_page_reader`` adapts ``HistoryStore.read_before`` (superseded
answers dropped, pages refilled). Per-message counts are cached (``MessageTokenCache``, at most
``MESSAGE_COUNTS_CACHED_MAX`` entries, keyed by model version, tokenizer, role and a digest of the
content), so building the next turn's context over the same history tokenizes only the new messages.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from infra.models.catalog import CatalogModel
from infra.models.tokens import count_message_tokens, count_system_tokens
from schemas.messages import ChatMessage

CONTEXT_PAGE_SIZE = 32
"""History messages asked for per read. About the budget of a small model in one read (SmolLM2's 2,048
tokens hold 6 messages of 300 tokens), few round trips for a large one, and a small over-read (at most
one page past the message that did not fit)."""

CONTEXT_PAGES_MAX = 64
"""Reads per build, at most: with ``CONTEXT_PAGE_SIZE`` it caps a build at 2,048 history messages read
and counted, whatever the model's window. Messages of 60 tokens or more fill a 128k window before
this bound; a history of tinier messages gets a context of its newest 2,048 (still a contiguous
suffix, under the budget)."""

MESSAGE_COUNTS_CACHED_MAX = 8192
"""Per-message token counts kept (least recently used dropped first). An entry is a 16-byte digest, two
shared strings and an int (about 200 bytes: under 2 MiB in all); 8,192 hold the in-window messages
of about a thousand active conversations of a small model."""

STORE_READS_PER_PAGE_MAX = 4
"""Store reads that make one page of the active branch (``history_page_reader``): the first, plus three
to replace answers superseded by regenerations. A page whose range holds more superseded answers than
that comes back short and the context ends there."""

CONTENT_DIGEST_BYTES = 16
"""BLAKE2b digest of a message's content in the cache key: a collision (which would give a wrong count)
is out of reach at 128 bits, and the key does not hold the content itself (bounded memory)."""


class TurnTooLarge(Exception):
    """The turn alone (with the system instructions) does not fit the model's input budget.

    Attributes:
        limit: the largest input the model takes with this ``max_output_tokens``:
            ``context_tokens - max_output_tokens`` (0 when that is negative).
        turn_tokens: what the system instructions plus the turn count.
    """

    def __init__(self, limit: int, turn_tokens: int) -> None:
        super().__init__(f"the turn needs {turn_tokens} input tokens; the model takes at most {limit} with this max_output_tokens")
        self.limit = limit
        self.turn_tokens = turn_tokens


class NoTurnToRegenerate(Exception):
    """Regenerate was asked, but the newest history item before ``history_before_seq`` is not a user
    message (or there is no history)."""


@dataclass(frozen=True, slots=True)
class HistoryItem:
    """One stored message of a conversation, as a page reader returns it."""

    seq: int  # the message's position in the conversation, increasing with time
    role: str  # "user" or "assistant"
    content: str


@dataclass(frozen=True, slots=True)
class BuiltContext:
    """The messages the engine sees (after the model's system instructions) and their count."""

    messages: tuple[ChatMessage, ...]  # oldest first; ends with the turn (the new one, or for regenerate the last user message)
    input_tokens: int  # == count_input_tokens(model, [(m.role, m.content) for m in messages])
    history_used: int  # history messages before the turn (for regenerate, the turn itself is not counted)
    oldest_seq: int | None  # seq of the oldest history message in ``messages`` (the turn's for regenerate), None if none
    pages_read: int


ReadPage = Callable[[int, int], Awaitable[Sequence[HistoryItem]]]
"""``read_page(before_seq, limit)``: at most ``limit`` items with ``seq < before_seq``, newest first."""

MessageCounter = Callable[[CatalogModel, str, str], int]
"""``counter(model, role, content)``: must equal ``count_message_tokens`` (it may cache or instrument)."""


class MessageTokenCache:
    """``count_message_tokens`` behind a bounded LRU keyed by (model version, tokenizer, role, content digest).

    Safe to share between threads (one lock around the dictionary; the tokenizer runs outside it).
    """

    def __init__(self, entries_max: int = MESSAGE_COUNTS_CACHED_MAX, counter: MessageCounter = count_message_tokens) -> None:
        assert entries_max > 0
        self.entries_max = entries_max
        self._counter = counter
        self._counts: OrderedDict[tuple[str, str, str, bytes], int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __call__(self, model: CatalogModel, role: str, content: str) -> int:
        digest = hashlib.blake2b(content.encode(), digest_size=CONTENT_DIGEST_BYTES).digest()
        key = (model.version, model.tokenizer.value, role, digest)
        with self._lock:
            count = self._counts.get(key)
            if count is not None:
                self._counts.move_to_end(key)
                self.hits += 1
                return count
        count = self._counter(model, role, content)
        with self._lock:
            self.misses += 1
            self._counts[key] = count
            self._counts.move_to_end(key)
            while len(self._counts) > self.entries_max:
                self._counts.popitem(last=False)
        return count

    def __len__(self) -> int:
        return len(self._counts)

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()
            self.hits = self.misses = 0


cached_message_tokens = MessageTokenCache()
"""The process's shared cache, ``build_context``'s default counter."""


async def build_context(
    model: CatalogModel,
    history_before_seq: int,
    read_page: ReadPage,
    new_turn: ChatMessage | None,
    max_output_tokens: int,
    *,
    page_size: int = CONTEXT_PAGE_SIZE,
    pages_max: int = CONTEXT_PAGES_MAX,
    counter: MessageCounter = cached_message_tokens,
) -> BuiltContext:
    """The newest contiguous history that fits ``model.context_tokens - max_output_tokens``, plus the turn.

    Args:
        model: the catalog model the turn runs on (its tokenizer, instructions and window).
        history_before_seq: only history with ``seq`` below this is read (the new turn's own seq, or
            for regenerate the seq just above the user message to answer again).
        read_page: the history reader (see ``ReadPage``).
        new_turn: the client's new message; ``None`` to regenerate (see the module docstring).
        max_output_tokens: reserved for the answer before any input is counted.
        page_size: history messages asked for per read.
        pages_max: reads at most.
        counter: per-message counts; must agree with ``count_message_tokens``.

    Raises:
        TurnTooLarge: the system instructions and the turn alone exceed the budget.
        NoTurnToRegenerate: ``new_turn`` is None and the newest history item is not a user message.
    """
    assert page_size > 0 and pages_max > 0
    budget = model.context_tokens - max_output_tokens
    used = count_system_tokens(model)
    before = history_before_seq
    pages_read = 0
    page: Sequence[HistoryItem] = ()
    start = 0  # index in ``page`` of the first item not yet considered

    if new_turn is None:
        page = await _read(read_page, before, page_size)
        pages_read = 1
        if not page or page[0].role != "user":
            raise NoTurnToRegenerate("regenerate needs a user message as the newest history item")
        turn = ChatMessage(page[0].role, page[0].content)
        turn_seq: int | None = page[0].seq
        start = 1
    else:
        turn = new_turn
        turn_seq = None
    used += counter(model, turn.role, turn.content)
    if used > budget:
        raise TurnTooLarge(limit=max(budget, 0), turn_tokens=used)

    taken: list[HistoryItem] = []  # newest first
    full = False
    while True:
        for item in page[start:]:
            n = counter(model, item.role, item.content)
            if used + n > budget:
                full = True  # never skip it for an older one: the context stays a contiguous suffix
                break
            taken.append(item)
            used += n
        if full or (pages_read and len(page) < page_size) or pages_read >= pages_max:
            break
        if page:
            before = page[-1].seq
        page = await _read(read_page, before, page_size)
        pages_read += 1
        start = 0

    taken.reverse()
    messages = (*(ChatMessage(h.role, h.content) for h in taken), turn)
    oldest = taken[0].seq if taken else turn_seq
    return BuiltContext(messages=messages, input_tokens=used, history_used=len(taken), oldest_seq=oldest, pages_read=pages_read)


class StoredLike(Protocol):
    """What ``history_page_reader`` needs of a stored message (``infra.stores.history.StoredMessage``)."""

    seq: int
    role: str
    content: str
    superseded_by: int | None


ReadBefore = Callable[[int, int], Awaitable[Sequence[StoredLike]]]
"""``read_before(before_seq, limit)``: stored messages with ``seq < before_seq``, newest first, superseded
ones included (``HistoryStore.read_before`` with its conversation id bound)."""


def history_page_reader(read_before: ReadBefore, reads_per_page_max: int = STORE_READS_PER_PAGE_MAX) -> ReadPage:
    """A ``ReadPage`` over the history store: the active branch only, in full pages.

    The store returns superseded answers too (a regenerated answer replaces the one it supersedes in
    the active branch, and the model must not see both). They are dropped here, and the store is
    asked again for what is missing, because ``build_context`` takes a short page for the start of
    the conversation. At most ``reads_per_page_max`` store reads make one page; past that the page is
    returned short, which ends the context early (a shorter context, never a wrong one).

    Usage: ``history_page_reader(functools.partial(store.read_before, conversation_id))``.
    """

    async def read_page(before_seq: int, limit: int) -> list[HistoryItem]:
        page: list[HistoryItem] = []
        for _ in range(reads_per_page_max):
            wanted = limit - len(page)
            rows = await read_before(before_seq, wanted)
            page.extend(HistoryItem(r.seq, r.role, r.content) for r in rows if r.superseded_by is None)
            if len(rows) < wanted or len(page) >= limit:
                break
            before_seq = rows[-1].seq
        return page

    return read_page


async def _read(read_page: ReadPage, before_seq: int, limit: int) -> Sequence[HistoryItem]:
    """One page, its contract checked: a reader that returned older-first or out-of-range items would
    silently build a context with a hole or a repeat in it."""
    page = await read_page(before_seq, limit)
    assert len(page) <= limit, f"read_page returned {len(page)} items for a limit of {limit}"
    previous = before_seq
    for item in page:
        assert item.seq < previous, f"read_page must return seq < {before_seq}, newest first; got {item.seq} after {previous}"
        previous = item.seq
    return page
