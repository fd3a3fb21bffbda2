"""A conversation's context built by tokens (edge/context.py): the budget, the newest contiguous
suffix, the exact count, the turn that cannot fit, regenerate, and the bounds on reading.

The history is an in-memory list read through ``InMemoryHistory.read_page`` (the input data of the
build, in the store's contract: newest first, ``seq < before``, at most ``limit``); it counts what it
returns so the tests can show a build reads O(budget) items, not O(history).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.context import (
    CONTEXT_PAGE_SIZE,
    CONTEXT_PAGES_MAX,
    MESSAGE_COUNTS_CACHED_MAX,
    BuiltContext,
    HistoryItem,
    MessageTokenCache,
    NoTurnToRegenerate,
    TurnTooLarge,
    build_context,
    history_page_reader,
)
from infra.models.catalog import CatalogModel, load_catalog, parse_catalog
from infra.models.tokens import (
    FALLBACK_BYTES_PER_TOKEN,
    FALLBACK_TOKENS_PER_MESSAGE,
    count_input_tokens,
    count_message_tokens,
    count_system_tokens,
    fallback_token_estimate,
)
from schemas.messages import ChatMessage

# An estimate-tokenized model: a message of 3k ASCII bytes counts k + FALLBACK_TOKENS_PER_MESSAGE.
SYSTEM = "Be brief."  # 9 bytes: 3 + 4 = 7 tokens
MODEL: CatalogModel = parse_catalog(
    f'[models.m]\nversion = "m-v1"\nengine = "sim"\ncontext_tokens = 1000\nsystem_instructions = "{SYSTEM}"\n'
).get("m")
SYSTEM_TOKENS = 7
MAX_OUTPUT = 200
BUDGET = MODEL.context_tokens - MAX_OUTPUT  # 800


def text_of(tokens: int, fill: str = "x") -> str:
    """Content that counts ``tokens`` in MODEL (framing included)."""
    assert tokens > FALLBACK_TOKENS_PER_MESSAGE
    return fill * ((tokens - FALLBACK_TOKENS_PER_MESSAGE) * FALLBACK_BYTES_PER_TOKEN)


class InMemoryHistory:
    """A conversation's stored messages, seq 1..n, read like the store reads them."""

    def __init__(self, contents: list[str]) -> None:
        self.items = [HistoryItem(seq, "user" if seq % 2 else "assistant", c) for seq, c in enumerate(contents, 1)]
        self._seqs = [h.seq for h in self.items]
        self.reads: list[tuple[int, int]] = []
        self.items_read = 0

    async def read_page(self, before_seq: int, limit: int) -> list[HistoryItem]:
        self.reads.append((before_seq, limit))
        end = bisect.bisect_left(self._seqs, before_seq)
        page = self.items[max(0, end - limit):end][::-1]
        self.items_read += len(page)
        return page

    @property
    def next_seq(self) -> int:
        return len(self.items) + 1


def pairs(messages) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in messages]


def assert_suffix_of(history: InMemoryHistory, built: BuiltContext, before_seq: int, turns: int = 1) -> None:
    """The context's history part is the newest ``history_used`` items below ``before_seq``, in order."""
    below = [h for h in history.items if h.seq < before_seq]
    expected = below[len(below) - built.history_used:] if built.history_used else []
    got = built.messages[: len(built.messages) - turns]
    assert [(m.role, m.content) for m in got] == [(h.role, h.content) for h in expected]
    if expected:
        assert built.oldest_seq == expected[0].seq


# --- the count: system + per message == count_input_tokens --------------------------------------------


MODELS = {"estimate": MODEL, "fast-text-model": load_catalog().get("fast-text-model")}


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=40, deadline=None)
@given(messages=st.lists(st.tuples(st.sampled_from(["user", "assistant"]), st.text(max_size=300)), max_size=6))
def test_system_plus_each_message_is_count_input_tokens(name, messages):
    model = MODELS[name]
    assert count_system_tokens(model) + sum(count_message_tokens(model, r, c) for r, c in messages) == count_input_tokens(model, messages)


def test_the_estimate_figures_are_unchanged():
    # The system instructions are counted like one more message, as fallback_token_estimate always did.
    assert count_system_tokens(MODEL) == SYSTEM_TOKENS == fallback_token_estimate([SYSTEM])
    assert count_message_tokens(MODEL, "user", "abcdefg") == math.ceil(7 / FALLBACK_BYTES_PER_TOKEN) + FALLBACK_TOKENS_PER_MESSAGE
    assert count_input_tokens(MODEL, [("user", "abcdef"), ("assistant", "")]) == fallback_token_estimate([SYSTEM, "abcdef", ""])


# --- the budget and the suffix ------------------------------------------------------------------------


async def test_the_context_is_the_newest_history_that_fits_plus_the_turn_counted_exactly():
    history = InMemoryHistory([text_of(100, fill=chr(ord("a") + i % 26)) for i in range(50)])
    turn = ChatMessage("user", text_of(50))
    built = await build_context(MODEL, history.next_seq, history.read_page, turn, MAX_OUTPUT, counter=count_message_tokens)
    # 7 (system) + 50 (turn) + 7 x 100 = 757 <= 800; an 8th would make 857.
    assert built.history_used == 7
    assert built.messages[-1] == turn
    assert built.input_tokens == count_input_tokens(MODEL, pairs(built.messages)) == 757
    assert built.input_tokens <= BUDGET
    assert_suffix_of(history, built, history.next_seq)
    assert built.oldest_seq == 44 and built.pages_read == 1


async def test_it_stops_at_the_first_message_that_does_not_fit_and_never_skips_past_it():
    # Newest first: two short messages, one that no longer fits, then many short ones that would.
    contents = [text_of(10)] * 20 + [text_of(790)] + [text_of(10)] * 2
    history = InMemoryHistory(contents)
    built = await build_context(MODEL, history.next_seq, history.read_page, ChatMessage("user", text_of(10)), MAX_OUTPUT)
    assert built.history_used == 2
    assert_suffix_of(history, built, history.next_seq)
    assert built.input_tokens == SYSTEM_TOKENS + 10 + 2 * 10
    assert built.input_tokens + 790 > BUDGET  # the next older message really does not fit


async def test_only_history_before_the_given_seq_is_read():
    history = InMemoryHistory([text_of(20) for _ in range(30)])
    built = await build_context(MODEL, 11, history.read_page, ChatMessage("user", "hi"), MAX_OUTPUT)
    assert built.history_used == 10 and built.oldest_seq == 1
    assert_suffix_of(history, built, 11)
    assert history.reads == [(11, CONTEXT_PAGE_SIZE)]  # one short page: no second read


async def test_an_empty_history_gives_the_turn_alone():
    history = InMemoryHistory([])
    turn = ChatMessage("user", "hello")
    built = await build_context(MODEL, 1, history.read_page, turn, MAX_OUTPUT)
    assert built.messages == (turn,) and built.history_used == 0 and built.oldest_seq is None
    assert built.input_tokens == count_input_tokens(MODEL, [("user", "hello")]) and built.pages_read == 1


async def test_a_turn_that_cannot_fit_alone_is_too_large_with_the_models_input_limit():
    history = InMemoryHistory([text_of(10)] * 5)
    turn = ChatMessage("user", text_of(BUDGET - SYSTEM_TOKENS + 1))
    with pytest.raises(TurnTooLarge) as err:
        await build_context(MODEL, history.next_seq, history.read_page, turn, MAX_OUTPUT)
    assert err.value.limit == BUDGET and err.value.turn_tokens == BUDGET + 1
    assert history.reads == []  # refused before any history is read
    # Exactly the budget fits, with no room for history.
    exact = ChatMessage("user", text_of(BUDGET - SYSTEM_TOKENS))
    built = await build_context(MODEL, history.next_seq, history.read_page, exact, MAX_OUTPUT)
    assert built.input_tokens == BUDGET and built.history_used == 0
    # A max_output_tokens over the whole window leaves no input at all.
    with pytest.raises(TurnTooLarge) as err:
        await build_context(MODEL, history.next_seq, history.read_page, ChatMessage("user", "hi"), MODEL.context_tokens + 5)
    assert err.value.limit == 0


# --- regenerate ---------------------------------------------------------------------------------------


async def test_regenerate_answers_the_newest_user_message_again_with_the_history_before_it():
    history = InMemoryHistory([text_of(100, fill=chr(ord("a") + i)) for i in range(12)])
    # Replace the answer at seq 12: the newest item before it is the user message at seq 11.
    built = await build_context(MODEL, 12, history.read_page, None, MAX_OUTPUT)
    assert built.messages[-1] == ChatMessage("user", history.items[10].content)
    assert built.input_tokens == count_input_tokens(MODEL, pairs(built.messages)) <= BUDGET
    assert built.history_used == 6  # 7 + 100 (the turn) + 6 x 100 = 707; a 7th would make 807
    assert_suffix_of(history, built, 11)
    assert built.pages_read == 1


async def test_regenerate_needs_a_user_message_to_answer_and_room_for_it():
    history = InMemoryHistory([text_of(10)] * 4)
    with pytest.raises(NoTurnToRegenerate):
        await build_context(MODEL, 5, history.read_page, None, MAX_OUTPUT)  # seq 4 is an answer
    with pytest.raises(NoTurnToRegenerate):
        await build_context(MODEL, 1, history.read_page, None, MAX_OUTPUT)  # no history
    alone = InMemoryHistory([text_of(10), text_of(10), text_of(BUDGET)])
    with pytest.raises(TurnTooLarge) as err:
        await build_context(MODEL, 4, alone.read_page, None, MAX_OUTPUT)
    assert err.value.limit == BUDGET
    built = await build_context(MODEL, 2, alone.read_page, None, MAX_OUTPUT)  # only seq 1
    assert built.history_used == 0 and built.oldest_seq == 1 and len(built.messages) == 1


# --- the bounds on reading ----------------------------------------------------------------------------


async def test_reads_stop_after_pages_max_even_when_more_would_fit():
    history = InMemoryHistory(["x"] * 10_000)  # 5 tokens each: the 800-token budget holds 157
    built = await build_context(MODEL, history.next_seq, history.read_page, ChatMessage("user", "hi"), MAX_OUTPUT, page_size=8, pages_max=3)
    assert built.pages_read == 3 and len(history.reads) == 3
    assert built.history_used == 24 and history.items_read == 24
    assert_suffix_of(history, built, history.next_seq)
    assert built.input_tokens == count_input_tokens(MODEL, pairs(built.messages))
    # The defaults bound a build at CONTEXT_PAGES_MAX pages too.
    big = InMemoryHistory(["x"] * (CONTEXT_PAGES_MAX * CONTEXT_PAGE_SIZE + 100))
    roomy = parse_catalog('[models.big]\nversion = "b"\nengine = "sim"\ncontext_tokens = 1000000\n').get("big")
    built = await build_context(roomy, big.next_seq, big.read_page, ChatMessage("user", "hi"), 10)
    assert built.pages_read == CONTEXT_PAGES_MAX and built.history_used == CONTEXT_PAGES_MAX * CONTEXT_PAGE_SIZE


@pytest.mark.parametrize("page_size", [1, 4, CONTEXT_PAGE_SIZE])
async def test_items_read_do_not_grow_with_the_conversation_once_the_budget_is_full(page_size):
    reads = {}
    for length in (10, 1_000, 10_000):
        history = InMemoryHistory([text_of(150)] * length)  # 10 x 150 > the 800-token budget
        built = await build_context(MODEL, history.next_seq, history.read_page, ChatMessage("user", "hi"), MAX_OUTPUT, page_size=page_size)
        assert built.history_used == 5 and built.input_tokens == count_input_tokens(MODEL, pairs(built.messages))
        reads[length] = (history.items_read, built.pages_read)
        # O(budget): the messages taken, the one that did not fit, and at most the rest of its page.
        assert history.items_read <= built.history_used + page_size
    assert reads[1_000] == reads[10_000]
    # A 10-message history already fills the budget: the same pages, and no more items than a page holds.
    assert reads[10][1] == reads[10_000][1] and reads[10][0] <= reads[10_000][0]
    if page_size < 10:
        assert reads[10] == reads[10_000]


async def test_a_reader_that_breaks_its_contract_fails_loudly():
    async def oldest_first(before_seq: int, limit: int):
        return [HistoryItem(1, "user", "a"), HistoryItem(2, "assistant", "b")]

    async def too_new(before_seq: int, limit: int):
        return [HistoryItem(before_seq, "user", "a")]

    for reader in (oldest_first, too_new):
        with pytest.raises(AssertionError):
            await build_context(MODEL, 10, reader, ChatMessage("user", "hi"), MAX_OUTPUT)


# --- the per-message count cache ----------------------------------------------------------------------


async def test_a_second_build_over_the_same_history_counts_only_new_messages():
    calls: list[str] = []

    def counting(model, role, content):
        calls.append(content)
        return count_message_tokens(model, role, content)

    cache = MessageTokenCache(counter=counting)
    history = InMemoryHistory([text_of(100, fill=chr(ord("a") + i % 26)) for i in range(40)])
    first = await build_context(MODEL, history.next_seq, history.read_page, ChatMessage("user", "q1"), MAX_OUTPUT, counter=cache)
    counted = len(calls)
    assert counted == first.history_used + 2  # the turn, the taken ones, the one that did not fit
    again = await build_context(MODEL, history.next_seq, history.read_page, ChatMessage("user", "q1"), MAX_OUTPUT, counter=cache)
    assert len(calls) == counted and again == first
    # Same content, another model version: counted again (its tokenizer may differ).
    other = parse_catalog(f'[models.m]\nversion = "m-v2"\nengine = "sim"\ncontext_tokens = 1000\nsystem_instructions = "{SYSTEM}"\n').get("m")
    await build_context(other, history.next_seq, history.read_page, ChatMessage("user", "q1"), MAX_OUTPUT, counter=cache)
    assert len(calls) == 2 * counted


def test_the_count_cache_is_bounded_and_drops_the_least_recently_used():
    cache = MessageTokenCache(entries_max=3)
    for content in ("a", "b", "c"):
        cache(MODEL, "user", content)
    cache(MODEL, "user", "a")  # now b is the least recently used
    cache(MODEL, "user", "d")
    assert len(cache) == 3 and cache.misses == 4 and cache.hits == 1
    cache(MODEL, "user", "a")
    cache(MODEL, "user", "b")  # evicted: counted again
    assert cache.hits == 2 and cache.misses == 5
    assert MESSAGE_COUNTS_CACHED_MAX > 0


# --- over the history store's read_before -------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """The fields of ``infra.stores.history.StoredMessage`` that the page reader uses."""

    seq: int
    role: str
    content: str
    superseded_by: int | None = None


def store_reader(rows: list[Stored]):
    """``read_before`` in the store's contract (superseded rows included); records every call."""
    calls: list[tuple[int, int]] = []

    async def read_before(before_seq: int, limit: int) -> list[Stored]:
        calls.append((before_seq, limit))
        return [r for r in sorted(rows, key=lambda r: -r.seq) if r.seq < before_seq][:limit]

    return read_before, calls


async def test_the_store_reader_drops_superseded_answers_and_refills_the_page():
    # 1 u, 2 a (superseded by 3), 3 a, 4 u, 5 a (superseded by 6), 6 a (superseded by 7), 7 a, 8 u
    rows = [Stored(1, "user", "q1"), Stored(2, "assistant", "old", 3), Stored(3, "assistant", "a1"),
            Stored(4, "user", "q2"), Stored(5, "assistant", "x", 6), Stored(6, "assistant", "y", 7),
            Stored(7, "assistant", "a2"), Stored(8, "user", "q3")]
    read_before, calls = store_reader(rows)
    read_page = history_page_reader(read_before)
    page = await read_page(9, 4)
    assert [h.seq for h in page] == [8, 7, 4, 3]
    assert calls == [(9, 4), (5, 2)]  # 6 and 5 superseded: two more asked for below 5
    assert [h.seq for h in await read_page(3, 4)] == [1]  # short: the start of the conversation
    built = await build_context(MODEL, 9, read_page, None, MAX_OUTPUT, page_size=2)  # regenerate the answer to q3
    assert [(m.role, m.content) for m in built.messages] == [("user", "q1"), ("assistant", "a1"), ("user", "q2"),
                                                             ("assistant", "a2"), ("user", "q3")]
    assert built.input_tokens == count_input_tokens(MODEL, pairs(built.messages))


async def test_the_store_reader_bounds_its_reads_per_page():
    rows = [Stored(1, "user", "q")] + [Stored(s, "assistant", "r", s + 1) for s in range(2, 100)]
    read_before, calls = store_reader(rows)
    page = await history_page_reader(read_before, reads_per_page_max=3)(100, 4)
    assert page == [] and len(calls) == 3  # short: the context ends here rather than read on
