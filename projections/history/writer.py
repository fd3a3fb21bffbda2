"""The history writer: stores conversation turns in Cassandra, then lets the ledger commit their answers.

    python -m projections.history      (env: CHATPLANE_KAFKA_BOOTSTRAP, CHATPLANE_NAMESPACE,
                                        CHATPLANE_CASSANDRA_*; docs/conversations.md)

Data flow::

    worker --AnswerSpooled--> ANSWERS (key user_id) --.
                                                       >-- this process (consumer group "<ns>.chatplane-history")
    processor --LedgerEntry--> LEDGER (key user_id) --'        |
                                                                |-- Cassandra: messages, conversations, index
                                                                `-- CommitAnswer --> COMMANDS (after the writes)

From the answers topic (the recoverable spool): the turn's user message (copied from ``turn_inputs``,
where the edge wrote it before submitting the turn) at ``turn_revision`` and the answer's text at
``turn_revision + 1``; only then ``CommitAnswer``, so the ledger never commits (and the edge never
announces ``generation.completed`` for) an answer whose only copy is in a process's memory.

From the ledger: a conversation's confirmation (created), its user turns (the same copy, so a turn
whose generation never reached a worker is stored too), the committed answer's status and the
replaced answer's ``superseded_by`` (regeneration), its revision and sidebar position, parks and
restores, and deletion (every row of it, and its generations' results).

At-least-once and idempotent: every write puts the same values under the same key, so a record
handled twice stores nothing twice; offsets are committed only after every write of the batch
succeeded. While Cassandra is unreachable a batch is retried with bounded backoff for
``WRITE_RETRY_WINDOW_S``, then the process exits non-zero and its restart resumes from the last
committed offset: a spooled answer is never lost to a crash or an outage (the answers topic keeps it
``ANSWERS.retention_ms``). Undecodable records are counted and skipped (dead-lettered by the read
model for the ledger; the answers topic has one writer, the workers, with the same schema).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from infra.stores.history import HistoryStore, HistoryUnavailable, StoredMessage
from infra.stores.schema import ReadModelSettings
from infra.runtime.command_client import CommandClient
from infra.runtime.log_limits import install_log_limits
from infra.runtime.metrics_http import metrics_port
from infra.runtime.event_loop import use_event_loop
from infra.runtime.settings import SettingsError, env_value, exit_on_settings_error, kafka_bootstrap
from schemas import events as ev
from schemas.commands import CommitAnswer
from schemas.messages import AnswerSpooled
from schemas.topics import Topology
from schemas.wire import WireError, decode_ledger_entry, decode_message
from projections.follower import POLL_TIMEOUT_MS, commit_offsets, follower_consumer, follower_group, run_follower
from projections.history.metrics import history_metrics

log = logging.getLogger("chatplane.history")

HISTORY_GROUP = "chatplane-history"
BATCH_RECORDS_MAX = 500  # records per poll, both topics together
WRITE_RETRY_BACKOFF_S_MIN = 0.2
WRITE_RETRY_BACKOFF_S_MAX = 2.0
WRITE_RETRY_WINDOW_S = 240.0  # then exit (below follower.MAX_POLL_INTERVAL_MS): the restart resumes from the commit
HISTORY_METRICS_PORT_ENV = "CHATPLANE_HISTORY_METRICS_PORT"  # Prometheus /metrics; 0: not served
# Ledger entries are decoded only if their bytes name a conversation event (most are not).
_CONVERSATION_MARK = b'"Conversation'


class WriterStalled(RuntimeError):
    """Cassandra stayed unreachable for ``WRITE_RETRY_WINDOW_S``."""


@dataclass
class HistoryStats:
    answers_stored: int = 0
    answers_skipped: int = 0  # their conversation was deleted (or never confirmed)
    turns_stored: int = 0
    turn_inputs_missing: int = 0  # a committed user turn whose text the edge never wrote (should stay 0)
    commits_sent: int = 0
    deletes: int = 0
    undecodable: int = 0
    write_retries: int = 0
    batches: int = 0
    # partition -> the next offset to handle (its batch written); the metrics' lag (follower.py).
    positions: dict[TopicPartition, int] = field(default_factory=dict, repr=False)


class HistoryWriter:
    def __init__(self, bootstrap: str, topology: Topology, store: HistoryStore, *, group_id: str | None = None) -> None:
        self.bootstrap = bootstrap
        self.topology = topology
        self.store = store
        self.group_id = group_id or follower_group(topology.namespace, HISTORY_GROUP)
        self.stats = HistoryStats()
        self.consumer: AIOKafkaConsumer | None = None
        # CommitAnswer goes through the shared command client, which keys it (by its user).
        self.commands = CommandClient.send_only(bootstrap, topology)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        await self.commands.start()
        self.consumer = follower_consumer(
            self.bootstrap, (self.topology.answers.name, self.topology.ledger.name), self.group_id, BATCH_RECORDS_MAX
        )
        await self.consumer.start()

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
        await self.commands.stop()

    async def run(self) -> None:
        assert self.consumer is not None
        while not self._stopping.is_set():
            polled = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_RECORDS_MAX)
            if polled:
                await self.process(polled)

    async def process(self, polled: dict[TopicPartition, list[Any]]) -> None:
        """Handle every record of one poll in offset order per partition, then commit the offsets."""
        assert self.consumer is not None
        offsets: dict[TopicPartition, int] = {}
        for tp, records in polled.items():
            for rec in records:
                await self._with_retries(self._handle, tp.topic, rec.value)
                offsets[tp] = rec.offset + 1
        self.stats.batches += 1
        await commit_offsets(self.consumer, offsets, self.stats.positions, log)  # after a rebalance the new owner redoes

    async def _with_retries(self, fn: Any, *args: Any) -> None:
        started = time.monotonic()
        backoff_s = WRITE_RETRY_BACKOFF_S_MIN
        while True:
            try:
                await fn(*args)
                return
            except (HistoryUnavailable, KafkaError) as exc:
                self.stats.write_retries += 1
                waited = time.monotonic() - started
                if waited > WRITE_RETRY_WINDOW_S:
                    raise WriterStalled(f"history writes failing for {waited:.0f}s: {type(exc).__name__}") from exc
                log.warning("history write failed (%s); retrying in %.1fs", type(exc).__name__, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(WRITE_RETRY_BACKOFF_S_MAX, backoff_s * 2)

    async def _handle(self, topic: str, value: bytes | None) -> None:
        if value is None:
            return
        if topic == self.topology.answers.name:
            try:
                spooled = decode_message(value)
            except WireError:
                self.stats.undecodable += 1
                return
            if isinstance(spooled, AnswerSpooled):
                await self.store_answer(spooled)
            return
        if _CONVERSATION_MARK not in value:
            return
        try:
            entry = decode_ledger_entry(value)
        except WireError:
            self.stats.undecodable += 1
            return
        for event in entry.events:
            await self.apply(event)

    # --- the spool -------------------------------------------------------------------------------

    async def store_answer(self, a: AnswerSpooled) -> None:
        """The user turn and the answer in Cassandra, then ``CommitAnswer`` (never before the writes)."""
        row = await self.store.get_conversation(a.conversation_id)
        if row is None or row.status == "deleted" or row.user_id != a.user_id:
            self.stats.answers_skipped += 1
            return
        parent = await self._parent_seq(a.conversation_id, a.turn_revision, a.regenerate)
        if not a.regenerate:
            await self._store_user_turn(a.conversation_id, a.turn_revision, a.generation_id, a.spooled_at_ms)
        await self.store.write_message(
            StoredMessage(
                conversation_id=a.conversation_id,
                seq=a.turn_revision + 1,
                role="assistant",
                content=a.text,
                status=None,  # the ledger's verdict (ConversationAnswerCommitted) sets it
                generation_id=a.generation_id,
                created_at_ms=a.spooled_at_ms,
                parent_seq=parent,
            )
        )
        self.stats.answers_stored += 1
        await self._send(
            CommitAnswer(
                command_id=f"commit-{a.generation_id}-{a.epoch}-{uuid.uuid4().hex[:8]}",
                user_id=a.user_id,
                issued_at_ms=int(time.time() * 1000),
                conversation_id=a.conversation_id,
                generation_id=a.generation_id,
                epoch=a.epoch,
            )
        )
        self.stats.commits_sent += 1

    async def _parent_seq(self, conversation_id: str, turn_revision: int, regenerate: bool) -> int:
        """The user turn an answer answers: its own turn's, or (regeneration) the replaced answer's."""
        if not regenerate:
            return turn_revision
        replaced = await self.store.read_after(conversation_id, turn_revision - 1, 1, turn_revision)
        return replaced[0].parent_seq if replaced else 0

    async def _store_user_turn(self, conversation_id: str, seq: int, generation_id: str, at_ms: int) -> None:
        spooled = await self.store.get_turn_input(generation_id)
        if spooled is None:
            self.stats.turn_inputs_missing += 1
            log.error("no stored text for the user turn of %s (seq %d of %s)", generation_id, seq, conversation_id)
            return
        _, content = spooled
        await self.store.write_message(
            StoredMessage(
                conversation_id=conversation_id,
                seq=seq,
                role="user",
                content=content,
                status="completed",
                generation_id=generation_id,
                created_at_ms=at_ms,
            )
        )
        self.stats.turns_stored += 1

    async def _send(self, command: Any) -> None:
        await self.commands.send(command)

    # --- the ledger ------------------------------------------------------------------------------

    async def apply(self, e: ev.Event) -> None:
        match e:
            case ev.ConversationCreated():
                # Its row (with the title) was written by the edge before the command; confirmed with
                # the row's own creation time, the one the edge's confirmation used too (one index row).
                row = await self.store.get_conversation(e.conversation_id)
                if row is not None and row.status is None and row.user_id == e.user_id:
                    await self.store.confirm_conversation(e.conversation_id, e.user_id, row.created_at_ms)
            case ev.ConversationTurnCommitted():
                if not e.regenerate:
                    await self._store_user_turn(e.conversation_id, e.revision, e.generation_id, e.occurred_at_ms)
                await self._revision(e.conversation_id, e.user_id, e.revision, e.occurred_at_ms)
            case ev.ConversationAnswerCommitted():
                await self._answer_committed(e)
            case ev.ConversationParked():
                await self.store.set_parked(e.conversation_id, e.revision)
            case ev.ConversationRestored():
                await self.store.set_parked(e.conversation_id, None)
            case ev.ConversationDeleted():
                await self._deleted(e)
            case _:
                pass

    async def _revision(self, conversation_id: str, user_id: str, revision: int, at_ms: int) -> None:
        row = await self.store.get_conversation(conversation_id)
        if row is None or row.status == "deleted" or row.revision > revision:
            return
        await self.store.set_revision(conversation_id, user_id, revision, at_ms, row.updated_at_ms)

    async def _answer_committed(self, e: ev.ConversationAnswerCommitted) -> None:
        row = await self.store.get_conversation(e.conversation_id)
        if row is None or row.status == "deleted":
            return
        if not e.spooled:
            # No worker spooled a text: an empty answer row unless a (late) spool stored one already.
            existing = await self.store.read_after(e.conversation_id, e.revision - 1, 1, e.revision)
            if not existing:
                parent = await self._parent_seq(e.conversation_id, e.revision - 1, e.replaces_seq > 0)
                await self.store.write_message(
                    StoredMessage(
                        conversation_id=e.conversation_id,
                        seq=e.revision,
                        role="assistant",
                        content="",
                        status=e.status,
                        generation_id=e.generation_id,
                        created_at_ms=e.occurred_at_ms,
                        parent_seq=parent,
                    )
                )
        await self.store.set_message_status(e.conversation_id, e.revision, e.status)
        if e.replaces_seq:
            await self.store.mark_superseded(e.conversation_id, e.replaces_seq, e.revision)
        await self._revision(e.conversation_id, e.user_id, e.revision, e.occurred_at_ms)

    async def _deleted(self, e: ev.ConversationDeleted) -> None:
        row = await self.store.get_conversation(e.conversation_id)
        if row is None:
            return  # deleted before (a redelivery)
        await self.store.mark_deleted(e.conversation_id)
        await self.store.delete_conversation(e.conversation_id, row.user_id, max(e.revision, row.revision), row.updated_at_ms)
        self.stats.deletes += 1


async def _main(args: argparse.Namespace, settings: ReadModelSettings) -> int:
    topology = Topology(args.namespace)
    store = await HistoryStore.open(settings)
    await store.ensure_schema()
    writer = HistoryWriter(args.bootstrap, topology, store, group_id=args.group or None)
    return await run_follower(
        writer,
        name="history",
        label="history writer",
        metrics=history_metrics(topology),  # served on CHATPLANE_HISTORY_METRICS_PORT (docs/metrics.md)
        metrics_port=args.metrics_port,
        stalled=WriterStalled,
        started=f"history writer: {topology.answers.name} + {topology.ledger.name} -> {settings.keyspace} (group {writer.group_id})",
        log=log,
        close_also=store.close,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m projections.history", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", default=kafka_bootstrap())
    parser.add_argument("--namespace", default=env_value("CHATPLANE_NAMESPACE", ""))
    parser.add_argument("--group", default=env_value("CHATPLANE_HISTORY_GROUP", ""), help="consumer group")
    args = parser.parse_args(argv)
    try:
        settings = ReadModelSettings()
        args.metrics_port = metrics_port(HISTORY_METRICS_PORT_ENV)
        use_event_loop()
    except SettingsError as exc:
        exit_on_settings_error(exc)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    install_log_limits()
    return asyncio.run(_main(args, settings))


if __name__ == "__main__":
    sys.exit(main())
