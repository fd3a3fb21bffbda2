"""The processor's table layout: a small hot value per user, one entry per settled request, and an
index of those entries in chunks by purge time.

Whole-aggregate values made every command re-encode and re-write everything the user did in the
last 24 hours (~270 KiB at steady state, docs/core.md). Settled request records (terminal, or
refused and kept for deduplication) change rarely: they are written once, under their own key. The
index of them (which key, at which revision) is itself split by when the records may be purged, so
that the hot value, written on every command, names a bounded number of index chunks however many
records the user holds (up to ``Policy.dedup_records_per_user_max``, 32,768):

    table ``user_to_ledger``
      <user_id>                                  -> 8-byte next deadline + readers + hot JSON
          {"layout": 3, "v": codec version, "ledger": the ledger without settled records (and
           without their usage), "recent": remembered decisions, "offset": applied offset,
           "chunks": {purge bucket: chunk revision}}
      NUL + >H len(user) + user + idem key + NUL + revision
                                                 -> {"record": RequestRecord, "usage": {key: UsageEntry}}
      NUL + FF FF + >H len(user) + user + purge bucket + NUL + revision
                                                 -> {idem key: revision} of the settled records whose
                                                    purge time falls in the bucket (``CHUNK_MS`` wide)

The readers section names the edges whose liveness the processor watches for this user (the
readers of its active generations, ``control_plane.decide.attached_readers``), so that a rescan
after a rebalance rebuilds that index without decoding any JSON: 0x01, a count byte, then per reader
a length byte and its id. It is absent (the JSON's ``{`` follows the deadline) when there are none,
and in values written before it existed.

A purge bucket spans ``CHUNK_MS`` (10 minutes) of purge times, so the hot value names at most
retention / ``CHUNK_MS`` + 1 chunks (145 for 24 h), and a command rewrites only the chunks whose
records it settled, changed or purged: those of 10 minutes of settling 24 h earlier or now.

Every entry's key carries the revision (the command offset) it was written at, so an entry is never
overwritten: a changed record or chunk gets a new key. Per command the writes go, in this order, to
the user's changelog partition: new settled entries, new chunks, the hot value, deletes of
superseded or purged entries and chunks. A crash keeps a prefix of them, and every prefix reads back
as the state before or after the command: the hot value only names chunks written before it, a
chunk only entries written before it, and deletes come last.

Values written in the older layouts still load: a whole aggregate (layout 1), and layout 2, whose
hot value named every settled entry itself (``"settled": {idem key: revision}``). The first
command after loading one rewrites it in this layout (the settled entries themselves are kept).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace


import orjson

from control_plane.aggregate import Aggregate, Remembered
from control_plane.codec import STATE_CODEC_VERSION, load_aggregate, load_ledger, load_record
from control_plane.decide import attached_readers, next_deadline_ms, purge_at_ms
from control_plane.policy import Policy
from control_plane.state import RequestRecord, UsageEntry, UserLedger

LAYOUT = 3
LAYOUT_NAMING_EVERY_ENTRY = 2  # the hot value's "settled" named every settled entry (still read)
# Width of a purge bucket of the settled-entry index: the hot value names one chunk per bucket.
CHUNK_MS = 10 * 60_000
_DEADLINE = struct.Struct(">q")
_LEN = struct.Struct(">H")
SETTLED_PREFIX = b"\x00"
# A user id is at most 128 characters (512 bytes), so no settled entry's length field is FF FF.
_CHUNK_MARK = b"\xff\xff"
_OPTIONS = orjson.OPT_NON_STR_KEYS
_READERS_MARK = 0x01
# Readers a hot value names at most (a count byte); a user's active generations are far fewer (its
# concurrency limit plus its queued work), and a reader id is at most 64 bytes (ReaderId).
READERS_NAMED_MAX = 255


def settled_key(user_id: str, idempotency_key: str, revision: int) -> bytes:
    user = user_id.encode()
    return SETTLED_PREFIX + _LEN.pack(len(user)) + user + idempotency_key.encode() + b"\x00" + str(revision).encode()


def chunk_key(user_id: str, bucket: int, revision: int) -> bytes:
    user = user_id.encode()
    return SETTLED_PREFIX + _CHUNK_MARK + _LEN.pack(len(user)) + user + str(bucket).encode() + b"\x00" + str(revision).encode()


def is_settled_key(key: bytes) -> bool:
    """Whether ``key`` is a settled entry or an index chunk (anything but a user's hot value)."""
    return key[:1] == SETTLED_PREFIX


def is_chunk_key(key: bytes) -> bool:
    return key[:3] == SETTLED_PREFIX + _CHUNK_MARK


def user_of_settled_key(key: bytes) -> str:
    """The user a settled entry or an index chunk belongs to."""
    start = 3 if is_chunk_key(key) else 1
    (n,) = _LEN.unpack_from(key, start)
    return key[start + 2 : start + 2 + n].decode()


def bucket_of(purge_at_ms: int) -> int:
    """The index chunk a settled record with this purge time is named in."""
    return purge_at_ms // CHUNK_MS


def unpack_deadline(value: bytes) -> int | None:
    (deadline,) = _DEADLINE.unpack_from(value)
    return deadline or None


def pack_readers(readers: frozenset[str]) -> bytes:
    if not readers:
        return b""
    names = sorted(readers)[:READERS_NAMED_MAX]
    out = bytearray((_READERS_MARK, len(names)))
    for name in names:
        raw = name.encode()[:255]
        out.append(len(raw))
        out += raw
    return bytes(out)


def unpack_readers(value: bytes) -> tuple[frozenset[str], int]:
    """The readers a hot value names, and where its JSON starts."""
    at = _DEADLINE.size
    if len(value) <= at or value[at] != _READERS_MARK:
        return frozenset(), at
    count = value[at + 1]
    at += 2
    names = []
    for _ in range(count):
        n = value[at]
        names.append(value[at + 1 : at + 1 + n].decode())
        at += 1 + n
    return frozenset(names), at


@dataclass(frozen=True, slots=True)
class Settled:
    """One settled entry as it is in the table: its revision and the exact objects it holds."""

    revision: int
    record: RequestRecord
    usage: tuple[tuple[str, UsageEntry], ...]
    purge_at_ms: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One index chunk as it is in the table: its revision and the entries it names."""

    revision: int
    members: dict[str, int]  # idempotency key -> revision of its settled entry


@dataclass(frozen=True, slots=True)
class Layout:
    """What of an aggregate is stored in settled entries and index chunks (empty for a whole-aggregate
    value), and what the last ``plan`` derived from it, so that a command that leaves the settled
    records alone costs no work proportional to them."""

    settled: dict[str, Settled] = field(default_factory=dict)
    usage: dict[str, UsageEntry] | None = None  # the ledger's usage mapping this layout was planned from
    hot_usage: dict[str, UsageEntry] = field(default_factory=dict)  # usage of no settled record
    # purge bucket -> chunk; None when the stored value named its settled entries itself (layout 2):
    # then the next plan writes every chunk.
    chunks: dict[int, Chunk] | None = field(default_factory=dict)
    index: bytes = b"{}"  # the hot value's "chunks" object, encoded
    min_purge_ms: int | None = None  # the earliest purge of a settled record


EMPTY_LAYOUT = Layout()


@dataclass(frozen=True, slots=True)
class TableWrites:
    """Changelog writes of one command, in the order they must be applied."""

    puts: list[tuple[bytes, bytes]]  # new settled entries, new chunks, then the hot value last
    deletes: list[bytes]  # superseded or purged settled entries and chunks, after the hot value
    layout: Layout
    deadline_ms: int | None  # = control_plane.decide.next_deadline_ms of the whole ledger
    readers: frozenset[str] = frozenset()  # = control_plane.decide.attached_readers


def _generation_of(usage_key: str) -> str:
    return usage_key.rpartition("/")[0]


def _usage_of(usage: dict[str, UsageEntry], generation_id: str) -> tuple[tuple[str, UsageEntry], ...]:
    prefix = generation_id + "/"
    return tuple((k, u) for k, u in usage.items() if k.startswith(prefix))


def _derived(settled: dict[str, Settled], usage: dict[str, UsageEntry]) -> tuple[dict[str, UsageEntry], int | None]:
    gens = {s.record.generation_id for s in settled.values()}
    hot_usage = {k: u for k, u in usage.items() if _generation_of(k) not in gens}
    min_purge = min((s.purge_at_ms for s in settled.values()), default=None)
    return hot_usage, min_purge


def _encode_index(chunks: dict[int, Chunk]) -> bytes:
    return orjson.dumps({b: c.revision for b, c in chunks.items()}, option=_OPTIONS)


def _plan_chunks(
    user: str,
    revision: int,
    stored: dict[str, Settled],
    settled: dict[str, Settled],
    old_chunks: dict[int, Chunk] | None,
) -> tuple[dict[int, Chunk], list[tuple[bytes, bytes]], list[bytes]]:
    """The index chunks of ``settled``, given those stored for ``stored``: (chunks, puts, deletes).

    Only the buckets of entries that were added, replaced or removed are rewritten."""
    dirty: dict[int, dict[str, int]] = {}  # bucket -> its new members
    if old_chunks is None:  # layout 2: no chunk stored yet, all are new
        chunks: dict[int, Chunk] = {}
        for k, entry in settled.items():
            dirty.setdefault(bucket_of(entry.purge_at_ms), {})[k] = entry.revision
    else:
        chunks = dict(old_chunks)

        def members(bucket: int) -> dict[str, int]:
            if bucket not in dirty:
                old = old_chunks.get(bucket)
                dirty[bucket] = dict(old.members) if old is not None else {}
            return dirty[bucket]

        for k, old_entry in stored.items():
            if settled.get(k) is not old_entry:
                members(bucket_of(old_entry.purge_at_ms)).pop(k, None)
        for k, entry in settled.items():
            if stored.get(k) is not entry:
                members(bucket_of(entry.purge_at_ms))[k] = entry.revision
    puts: list[tuple[bytes, bytes]] = []
    deletes: list[bytes] = []
    for bucket, new_members in dirty.items():
        old = chunks.pop(bucket, None)
        if old is not None and old.members == new_members:
            chunks[bucket] = old
            continue
        if new_members:
            chunks[bucket] = Chunk(revision, new_members)
            puts.append((chunk_key(user, bucket, revision), orjson.dumps(new_members)))
        if old is not None and (not new_members or old.revision != revision):
            deletes.append(chunk_key(user, bucket, old.revision))  # same revision: the put replaced it
    return chunks, puts, deletes


def plan(aggregate: Aggregate, layout: Layout, policy: Policy) -> TableWrites:
    """The writes that store ``aggregate`` given what ``layout`` says is stored already."""
    ledger = aggregate.ledger
    user = ledger.user_id
    revision = aggregate.source_offset
    usage = ledger.usage
    stored = layout.settled
    touched: set[str] = set()  # generations whose usage changed since the layout was planned
    if usage is not layout.usage:
        old_usage = layout.usage or {}
        touched = {_generation_of(k) for k, u in usage.items() if old_usage.get(k) is not u}
        touched.update(_generation_of(k) for k in old_usage if k not in usage)
    settled: dict[str, Settled] = {}
    puts: list[tuple[bytes, bytes]] = []
    hot_requests: dict[str, RequestRecord] = {}
    for k, record in ledger.requests.items():
        old = stored.get(k)
        if old is not None and old.record is record and (not touched or record.generation_id not in touched):
            settled[k] = old  # stored as it is (the same object cannot have become active)
            continue
        if record.status.active:
            hot_requests[k] = record
            continue
        entry_usage = _usage_of(usage, record.generation_id)
        if old is not None and old.record is record and old.usage == entry_usage:
            settled[k] = old
            continue
        purge_at = purge_at_ms(record, policy)
        entry = Settled(revision, record, entry_usage, purge_at if purge_at is not None else 0)
        settled[k] = entry
        value = orjson.dumps({"record": record, "usage": dict(entry_usage)}, option=_OPTIONS)
        puts.append((settled_key(user, k, revision), value))
    rewritten = {key for key, _ in puts}  # same revision (no offset given): the put replaces it
    deletes = [
        key
        for k, old in stored.items()
        if settled.get(k) is not old and (key := settled_key(user, k, old.revision)) not in rewritten
    ]
    if puts or deletes or len(settled) != len(stored) or layout.chunks is None:
        chunks, chunk_puts, chunk_deletes = _plan_chunks(user, revision, stored, settled, layout.chunks)
        puts.extend(chunk_puts)
        deletes.extend(chunk_deletes)
        index = _encode_index(chunks) if chunk_puts or chunk_deletes or layout.chunks is None else layout.index
        hot_usage, min_purge = _derived(settled, usage)
    elif usage is not layout.usage:
        chunks, index, min_purge = layout.chunks, layout.index, layout.min_purge_ms
        hot_usage = _derived(settled, usage)[0]
    else:
        chunks, hot_usage, index, min_purge = layout.chunks, layout.hot_usage, layout.index, layout.min_purge_ms
    hot = replace(ledger, requests=hot_requests, usage=hot_usage, by_generation={})
    deadline = next_deadline_ms(hot, policy)
    if min_purge is not None and (deadline is None or min_purge < deadline):
        deadline = min_purge
    recent = [[r.command_id, orjson.Fragment(r.encoded)] for r in aggregate.recent]
    doc = {
        "layout": LAYOUT,
        "v": STATE_CODEC_VERSION,
        "ledger": hot,
        "recent": recent,
        "offset": aggregate.source_offset,
        "chunks": orjson.Fragment(index),
    }
    readers = attached_readers(hot)
    value = _DEADLINE.pack(deadline or 0) + pack_readers(readers) + orjson.dumps(doc, option=_OPTIONS)
    puts.append((user.encode(), value))
    return TableWrites(puts, deletes, Layout(settled, usage, hot_usage, chunks, index, min_purge), deadline, readers)


def join(value: bytes, read: Callable[[bytes], bytes | None], policy: Policy) -> tuple[Aggregate, Layout]:
    """The aggregate stored as ``value`` (a user's hot value), reading its chunks and settled entries."""
    body = memoryview(value)[unpack_readers(value)[1] :]
    doc = orjson.loads(body)
    layout_version = doc.get("layout")
    if layout_version not in (LAYOUT, LAYOUT_NAMING_EVERY_ENTRY):
        return load_aggregate(bytes(body)), EMPTY_LAYOUT
    if doc.get("v") != STATE_CODEC_VERSION:
        raise ValueError(f"unsupported state codec version {doc.get('v')!r}")
    hot = load_ledger(doc["ledger"])
    user = hot.user_id
    chunks: dict[int, Chunk] | None = None
    if layout_version == LAYOUT:
        chunks = {}
        names: dict[str, int] = {}
        for b, revision in doc["chunks"].items():
            bucket = int(b)
            raw = read(chunk_key(user, bucket, revision))
            if raw is None:
                raise ValueError(f"index chunk {bucket}@{revision} of user {user!r} is missing from the table")
            chunks[bucket] = Chunk(revision, orjson.loads(raw))
            names.update(chunks[bucket].members)
    else:
        names = doc["settled"]
    requests = dict(hot.requests)
    usage = dict(hot.usage)
    settled: dict[str, Settled] = {}
    for k, revision in names.items():
        raw = read(settled_key(user, k, revision))
        if raw is None:
            raise ValueError(f"settled record {k!r}@{revision} of user {user!r} is missing from the table")
        entry = orjson.loads(raw)
        record = load_record(entry["record"])
        entries = tuple((uk, UsageEntry(**u)) for uk, u in entry["usage"].items())
        purge_at = purge_at_ms(record, policy)
        settled[k] = Settled(revision, record, entries, purge_at if purge_at is not None else 0)
        requests[k] = record
        usage.update(entries)
    ledger = replace(
        hot,
        requests=requests,
        usage=usage,
        by_generation={r.generation_id: k for k, r in requests.items()},
    )
    recent = tuple(Remembered(command_id, orjson.dumps(d)) for command_id, d in doc["recent"])
    hot_usage, min_purge = _derived(settled, usage)
    index = _encode_index(chunks) if chunks is not None else b"{}"
    return Aggregate(ledger, recent, doc.get("offset", -1)), Layout(settled, usage, hot_usage, chunks, index, min_purge)


def join_table(items: Iterable[tuple[bytes, bytes | None]], policy: Policy) -> dict[str, UserLedger]:
    """Every user's ledger from a table's latest values (for the auditor)."""
    latest = {k: v for k, v in items if v is not None}
    return {k.decode(): join(v, latest.get, policy)[0].ledger for k, v in latest.items() if not is_settled_key(k)}


def write_all(aggregates: Iterable[Aggregate], policy: Policy) -> dict[bytes, bytes]:
    """A table holding ``aggregates`` in this layout (tests and benchmarks)."""
    table: dict[bytes, bytes] = {}
    for aggregate in aggregates:
        table.update(plan(aggregate, EMPTY_LAYOUT, policy).puts)
    return table


__all__ = [
    "CHUNK_MS",
    "EMPTY_LAYOUT",
    "Chunk",
    "Layout",
    "TableWrites",
    "bucket_of",
    "chunk_key",
    "is_chunk_key",
    "is_settled_key",
    "join",
    "join_table",
    "plan",
    "settled_key",
    "unpack_deadline",
    "unpack_readers",
    "user_of_settled_key",
    "write_all",
]

