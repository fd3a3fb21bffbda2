"""Benchmark of building a conversation turn's context by tokens (``edge.context.build_context``).

A script, not a test. For conversations of 10, 1,000 and 10,000 messages (about 300 tokens each,
alternating user/assistant) it times one context build for ``fast-text-model`` (2,048-token window,
``--max-output`` reserved), with the model's real tokenizer when it is installed (the byte estimate
otherwise; the header says which), three ways, in the same run:

- ``cold``: ``build_context`` with no count cache: every message it reads is tokenized;
- ``warm``: ``build_context`` with its per-message count cache, as repeated turns over the same
  history run (only the messages new since the last build are tokenized);
- ``baseline``: what a builder that reads the whole conversation does: read every message, count
  every one, keep the newest suffix that fits. O(length), shown for contrast.

Each build reads history through a page reader: by default an in-memory one (the store's contract,
newest first); with ``--cassandra`` the real ``HistoryStore.read_before`` in a fresh keyspace (dropped
at the end), through ``edge.context.history_page_reader``. Once the budget is full, ``cold`` and
``warm`` must not grow with the length: the table shows the items each build read and, over
Cassandra, the statements (one per 64-message bucket the page spans: it depends on where the newest
seq falls in its bucket, not on the conversation's length).

    .venv/bin/python bench/bench_context.py [--builds 300] [--baseline-builds 10] [--cassandra] [--lengths 10,1000,10000]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge.context import (  # noqa: E402
    CONTEXT_PAGE_SIZE,
    BuiltContext,
    HistoryItem,
    MessageTokenCache,
    ReadPage,
    build_context,
    history_page_reader,
)
from infra.models.catalog import load_catalog  # noqa: E402
from infra.models.tokens import count_message_tokens, count_system_tokens, vocabulary_path  # noqa: E402
from schemas.messages import ChatMessage  # noqa: E402

ALIAS = "fast-text-model"
LENGTHS = (10, 1_000, 10_000)
MESSAGE_TOKENS = 300
WORDS = (
    "the quick brown fox jumps over a lazy dog while the model streams tokens to a client that reads "
    "quota windows budgets partitions ledgers naïve café 漢字 🙂 congestion control retries answers"
).split()
BASELINE_PAGE = 256  # the store's largest read (MESSAGES_READ_MAX)
CASSANDRA_WRITES_IN_FLIGHT = 32


def make_history(model, length: int, seed: int) -> list[HistoryItem]:
    """``length`` messages of about MESSAGE_TOKENS each, every one distinct (so no count is shared)."""
    rnd = random.Random(seed)
    sample = " ".join(rnd.choices(WORDS, k=400))
    words_per_message = round(400 * (MESSAGE_TOKENS - 4) / (count_message_tokens(model, "user", sample) - 4))
    return [
        HistoryItem(seq, "user" if seq % 2 else "assistant", f"[{seq}] " + " ".join(rnd.choices(WORDS, k=words_per_message)))
        for seq in range(1, length + 1)
    ]


class CountingReader:
    """Wraps a page reader; counts the items each build reads."""

    def __init__(self, inner: ReadPage) -> None:
        self.inner = inner
        self.items = 0

    async def __call__(self, before_seq: int, limit: int):
        page = await self.inner(before_seq, limit)
        self.items += len(page)
        return page


def memory_reader(items: list[HistoryItem]) -> ReadPage:
    seqs = [h.seq for h in items]

    async def read_page(before_seq: int, limit: int) -> list[HistoryItem]:
        end = bisect.bisect_left(seqs, before_seq)
        return items[max(0, end - limit):end][::-1]

    return read_page


async def baseline(model, before_seq: int, read_page: ReadPage, turn: ChatMessage, max_output: int) -> int:
    """Read the whole conversation, count every message, keep the newest suffix that fits."""
    everything: list[HistoryItem] = []
    before = before_seq
    while True:
        page = await read_page(before, BASELINE_PAGE)
        everything.extend(page)
        if len(page) < BASELINE_PAGE:
            break
        before = page[-1].seq
    counts = [count_message_tokens(model, h.role, h.content) for h in everything]
    used = count_system_tokens(model) + count_message_tokens(model, turn.role, turn.content)
    budget = model.context_tokens - max_output
    taken = 0
    for n in counts:
        if used + n > budget:
            break
        used += n
        taken += 1
    return used


async def timed(n: int, fn: Callable[[], Awaitable[object]]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def pct(xs: list[float], q: int) -> float:
    """The q-th percentile in ms (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))] * 1e3


async def measure(model, length: int, read_page: ReadPage, turn: ChatMessage, args, bucket_of=None) -> dict:
    reader = CountingReader(read_page)
    before = length + 1
    cold = lambda: build_context(model, before, reader, turn, args.max_output, counter=count_message_tokens)  # noqa: E731
    cache = MessageTokenCache()
    warm = lambda: build_context(model, before, reader, turn, args.max_output, counter=cache)  # noqa: E731
    first: BuiltContext = await cold()  # noqa: F841 - loads the vocabulary; the figures below are per build
    reader.items = 0
    built = await cold()
    items_per_build = reader.items
    await warm()  # fills the cache: the turns before this one counted these messages already
    # Alternate in rounds so drift on a shared machine hits every variant.
    t_cold: list[float] = []
    t_warm: list[float] = []
    t_base: list[float] = []
    rounds = 5
    for _ in range(rounds):
        t_cold += await timed(args.builds // rounds, cold)
        t_warm += await timed(args.builds // rounds, warm)
    base_n = max(1, args.baseline_builds)
    t_base = await timed(base_n, lambda: baseline(model, before, reader, turn, args.max_output))
    assert await baseline(model, before, read_page, turn, args.max_output) == built.input_tokens
    return {
        "length": length, "cold": t_cold, "warm": t_warm, "base": t_base, "items": items_per_build,
        "pages": built.pages_read, "used": built.history_used, "tokens": built.input_tokens,
        # Cassandra statements per build: one per messages bucket the page spans (seqs are dense).
        "queries": None if bucket_of is None else bucket_of(length) - bucket_of(length - items_per_build + 1) + 1,
    }


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(f"{'messages':>9} {'used':>5} {'input_tok':>9} {'pages':>5} {'items_read':>10} {'queries':>7} "
          f"{'cold p50':>9} {'cold p99':>9} {'warm p50':>9} {'warm p99':>9} {'baseline p50':>12} {'baseline p99':>12}  (ms)")
    for r in rows:
        queries = "-" if r["queries"] is None else r["queries"]
        print(f"{r['length']:>9,} {r['used']:>5} {r['tokens']:>9} {r['pages']:>5} {r['items']:>10} {queries:>7} "
              f"{pct(r['cold'], 50):>9.3f} {pct(r['cold'], 99):>9.3f} {pct(r['warm'], 50):>9.3f} {pct(r['warm'], 99):>9.3f} "
              f"{pct(r['base'], 50):>12.2f} {pct(r['base'], 99):>12.2f}")
    small, large = rows[0], rows[-1]
    print(f"growth {small['length']:,} -> {large['length']:,} messages (p50): cold x{statistics.median(large['cold']) / statistics.median(small['cold']):.2f}, "
          f"warm x{statistics.median(large['warm']) / statistics.median(small['warm']):.2f}, "
          f"baseline x{statistics.median(large['base']) / statistics.median(small['base']):.1f}")


async def run_memory(model, turn, args) -> list[dict]:
    rows = []
    for length in args.lengths:
        items = make_history(model, length, seed=length)
        rows.append(await measure(model, length, memory_reader(items), turn, args))
    return rows


async def run_cassandra(model, turn, args) -> list[dict]:
    from infra.stores.history import HistoryStore, StoredMessage, bucket_of
    from infra.stores.schema import ReadModelSettings
    from infra.stores.cassandra import execute

    keyspace = f"bench_context_{uuid.uuid4().hex[:10]}"
    store = await HistoryStore.open(ReadModelSettings(keyspace=keyspace))
    try:
        rows = []
        for length in args.lengths:
            conversation_id = f"conv-{length}"
            items = make_history(model, length, seed=length)
            gate = asyncio.Semaphore(CASSANDRA_WRITES_IN_FLIGHT)
            t0 = time.perf_counter()

            async def write(h: HistoryItem) -> None:
                async with gate:
                    await store.write_message(StoredMessage(
                        conversation_id=conversation_id, seq=h.seq, role=h.role, content=h.content, status="completed",
                        generation_id=f"gen-{length}-{h.seq}", created_at_ms=h.seq, parent_seq=0,
                    ))

            await asyncio.gather(*(write(h) for h in items))
            print(f"  wrote {length:,} messages in {time.perf_counter() - t0:.1f} s", flush=True)
            read_page = history_page_reader(functools.partial(store.read_before, conversation_id))
            rows.append(await measure(model, length, read_page, turn, args, bucket_of=bucket_of))
        return rows
    finally:
        try:
            await execute(store.session, f"DROP KEYSPACE IF EXISTS {keyspace}", timeout_s=60)
        finally:
            await store.close()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", type=int, default=300, help="timed builds per variant and length (cold and warm)")
    ap.add_argument("--baseline-builds", type=int, default=10, help="timed whole-history builds per length")
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--cassandra", action="store_true", help="read through HistoryStore in a fresh keyspace")
    ap.add_argument("--lengths", type=lambda v: tuple(int(x) for x in v.split(",")), default=LENGTHS,
                    help="conversation lengths, comma-separated (default 10,1000,10000)")
    args = ap.parse_args()
    model = load_catalog().get(ALIAS)
    tokenizer = "SmolLM2 GGUF vocabulary (llama.cpp)" if vocabulary_path(model) else "byte estimate (no GGUF vocabulary here)"
    turn = ChatMessage("user", make_history(model, 1, seed=1)[0].content)
    sample = make_history(model, 50, seed=3)
    mean_tokens = statistics.mean(count_message_tokens(model, h.role, h.content) for h in sample)
    store = "Cassandra HistoryStore.read_before" if args.cassandra else "in-memory page reader"
    header = (f"bench_context: {ALIAS}, context {model.context_tokens} tokens, max_output {args.max_output}, "
              f"tokenizer: {tokenizer}\n  messages ~{mean_tokens:.0f} tokens; history via {store}, page {CONTEXT_PAGE_SIZE}; "
              f"{args.builds} builds per cold/warm, {args.baseline_builds} per baseline")
    rows = await (run_cassandra(model, turn, args) if args.cassandra else run_memory(model, turn, args))
    print_table(rows, header)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
