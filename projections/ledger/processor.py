"""The admission processor: the ledger core run on Kafka with faust-streaming.

    COMMANDS (key user_id) --> agent ``admission`` (concurrency=1, one per partition)
        table ``user_to_ledger``[user_id] = aggregate      (one changelog write per command)
        control_plane.aggregate.handle -> Decision          (pure; redeliveries answered from memory)
        control_plane.routing.route    -> LEDGER, reply_to, DISPATCH, WORKER_CONTROL, USAGE
    timer ``reconcile`` (timer.py) --> ReconcileDue commands for users whose deadlines passed (via COMMANDS)
                      --> DetachReader for generations read by an edge that stopped renewing its
                          liveness lease (EDGE_PRESENCE, presence.py), AttachReader if it comes back
    undecodable commands --> DEAD_LETTER with reason and offset; the partition keeps moving

Delivery is at-least-once (faust flushes the producer before it commits offsets), not faust's
exactly-once mode (faust-streaming #517, #323, #177): decisions are deterministic and derived ids
make every output idempotent for its readers.

The ledger entry comes first. The agent decides commands in order and hands each one's ledger entry
to the producer at once; its other outputs (reply, dispatch, stops, finalization, usage) leave only
after Kafka acknowledged that entry, a batch of commands per wait (``_drain``), so no client is told
"admitted" and no worker handed a dispatch for a decision the ledger does not hold.

State is never durable ahead of the outputs it implies: a command's new aggregate is written to the
table (its changelog) and the command acked (made committable) only after Kafka acknowledged every
output of it, in command order (``_drain``). After a kill -9 the restored table therefore reflects a prefix of
commands whose outputs are all in the log; commands after it are redelivered and decided again
from that state, with the same derived ids. (Writing the table first lost the ledger events of a
command whose state reached the changelog while its events did not; its redelivery was skipped as
already applied and the audit found the table ahead of the ledger.)

The one input that is not in the log is the time a submit is read, against its decision deadline:
the agent stamps it into the command (``SubmitGeneration.read_at_ms``) before ``handle``, ``route``
records it on the ledger entry, and a command decided again after a crash gets the recorded stamp
back (``read_stamps``, read from the ledger's tail at assignment).

faust is used here through its public API; every place the processor goes around it (the raw
producer, the table's changelog and store, the consumer's gap bookkeeping, the Monitor sensor, the
consumer's assignment) is a function of ``faust_adapter``, which says why and what it relies on.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable

import os

import faust
from faust.types import TP

from control_plane.aggregate import Aggregate, handle
from control_plane.routing import Outbound, route
from projections.ledger import faust_adapter
from projections.ledger.metrics import ProcessorMetrics
from infra.runtime.gc_tuning import tune_gc
from infra.runtime.kafka_admin import TopologyError, assert_copartitioned, assert_topology
from infra.runtime.kafka_settings import kafka_client_kwargs, kafka_compression
from infra.runtime import memtrace, tracing
from infra.runtime.malloc_tuning import tune_malloc
from infra.runtime.log_limits import install_log_limits
from infra.runtime.metrics_http import MetricsPortUnavailable, start_metrics_server
from infra.runtime.event_loop import use_event_loop
from infra.runtime.settings import SettingsError, exit_on_settings_error, log_level
from projections.ledger.settings import ProcessorSettings
from projections.ledger.presence import PresenceWatch
from projections.ledger.read_stamps import recall_read_stamps
from projections.ledger.table_store import (
    EMPTY_LAYOUT,
    Layout,
    TableWrites,
    is_settled_key,
    join,
    plan,
)
from projections.ledger.timer import ReconcileTimer, TimerLimits, user_partition
from schemas.commands import SubmitGeneration
from schemas.topics import TIERS, USER_TO_LEDGER_TABLE
from schemas.wire import WireError, decode_command, encode

log = logging.getLogger("chatplane.processor")

DEAD_LETTER_VALUE_BYTES_MAX = 4_096  # how much of an undecodable message the dead letter keeps


@dataclass(slots=True)
class _Pending:
    """One decided command waiting for Kafka to acknowledge its ledger entry, then its outputs."""

    partition: int
    sends: list[Awaitable[Any]] = field(default_factory=list)  # delivery futures of its ledger entry (or dead letter)
    outputs: list[Outbound] = field(default_factory=list)  # sent once ``sends`` are acknowledged
    headers: Any = None  # the trace context every output carries
    key: bytes | None = None  # the user whose table entries to write once they are acknowledged
    writes: TableWrites | None = None  # None: nothing to write
    aggregate: Aggregate | None = None
    event: Any = None  # the faust event to ack after the write
    skipped: tuple[int, int] | None = None  # offsets faust never delivered, decided by _fill_gap
    decided_at: float = 0.0  # perf_counter when decided (0: nothing decided), for the durable latency


def _acknowledged(send: Awaitable[Any]) -> bool:
    """A delivery future that has resolved (either way: awaiting it then raises a failure)."""
    done = getattr(send, "done", None)
    return bool(done and done())


@dataclass
class ProcessorStats:
    commands: int = 0
    redelivered: int = 0
    redelivered_forgotten: int = 0
    dead_lettered: int = 0
    reconciles_appended: int = 0
    gaps: int = 0  # holes in faust's delivery of a partition, filled by reading Kafka directly
    gap_commands: int = 0
    readers_detached: int = 0  # DetachReader sent for a generation whose reader's edge was lost
    readers_reattached: int = 0  # AttachReader sent: the edge was heard again inside the grace
    readers_unwatched: int = 0  # users not watched: readers_tracked_max reached
    recovery_restarts: int = 0  # changelog partitions a stalled table recovery read again


class AdmissionProcessor:
    """Owns the faust app, its table and the deadline index of the partitions assigned here."""

    def __init__(self, settings: ProcessorSettings) -> None:
        self.settings = settings
        self.topology = settings.topology
        self.policy = settings.policy
        self.stats = ProcessorStats()
        # Prometheus series (projections/ledger/metrics.py), served on CHATPLANE_PROCESSOR_METRICS_PORT.
        self.metrics = ProcessorMetrics(self.policy.concurrency_limit, settings.metrics_reservations_max)
        self.metrics.bind(self)
        self.partitions = self.topology.commands.partitions
        self.app = faust.App(
            self.topology.processor_app_id,
            broker=f"kafka://{settings.kafka_bootstrap}",
            store="memory://",
            datadir=settings.data_dir,
            topic_partitions=self.partitions,
            topic_allow_declare=False,
            # No agent or timer here runs on the leader only, so no leader election: faust would
            # otherwise subscribe to "<app id>-__assignor-__leader", which it may not create
            # (topic_allow_declare) and create-topics does not make, and aiokafka would log an ERROR
            # that the topic is missing at every metadata refresh (every 5 minutes).
            topic_disable_leader=True,
            table_standby_replicas=0,
            broker_commit_interval=settings.commit_interval_s,
            # Static membership: a restarted instance takes its partitions back at once instead of
            # waiting for the dead member's session to time out.
            consumer_group_instance_id=settings.instance_id,
            broker_session_timeout=settings.session_timeout_s,
            broker_heartbeat_interval=settings.session_timeout_s / 4,
            producer_acks=-1,
            producer_linger_ms=1,
            producer_compression_type=kafka_compression(),
            consumer_auto_offset_reset="earliest",
            processing_guarantee="at_least_once",
            web_enabled=False,
        )
        # Before the first topic: the app's consumer and producer pace their retries as every client of ours.
        faust_adapter.use_kafka_client_settings(self.app)
        self.commands = self.app.topic(
            self.topology.commands.name,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=self.partitions,
            internal=False,
        )
        self.table = self.app.Table(
            USER_TO_LEDGER_TABLE, partitions=self.partitions, key_type=bytes, value_type=bytes, default=None
        )
        # user key -> (the exact hot table value, the aggregate joined from it, its layout). An
        # identity check against the table value detects a recovery or another instance's write.
        self._decoded: dict[bytes, tuple[bytes, Aggregate, Layout]] = {}
        # Decided commands, oldest first, whose outputs Kafka has not acknowledged yet; and per user
        # the newest aggregate decided here that is not yet written to the table (ahead of it).
        self._pending: deque[_Pending] = deque()
        self._unwritten: dict[bytes, tuple[Aggregate, Layout]] = {}
        # partition -> the offset the next command of it must have (from the committed offset at
        # assignment, then the last delivered one); a larger offset reveals commands faust skipped.
        self._expected: dict[int, int] = {}
        # partition -> command id -> the read stamp a decision of it recorded on the ledger (before a
        # crash, possibly by another instance): a command read again gets that stamp (read_stamps.py).
        self._recalled: dict[int, dict[str, int]] = {}
        self._recall_error: Exception | None = None
        self._expected_known = asyncio.Event()
        self._expected_known.set()
        self._faults_skip = set(settings.fault_skip_deliveries)
        self._fault_batches = 0  # batches that reached CHATPLANE_FAULT_EXIT_AT's point
        self._pending_added = asyncio.Event()
        self._pending_room = asyncio.Event()
        # Edge liveness (presence.py), and the timer (timer.py): the deadline index and the reader watch
        # of the partitions here; it reads the table and the aggregates decided ahead of it, sends commands.
        self.presence_watch = PresenceWatch(
            settings.kafka_bootstrap, self.topology, settings.edge_lease_ms, settings.edges_tracked_max
        )
        self.presence = self.presence_watch.view
        self.timer = ReconcileTimer(
            TimerLimits.of(settings),
            self.policy,
            self.partitions,
            self.presence,
            self.stats,
            assigned=self.assigned_command_partitions,
            table_entries=self.table.items,
            unwritten=self._unwritten_aggregates,
            aggregate_of=self._aggregate_only,
            send=self._send_command,
        )
        self.app.agent(self.commands, name="admission", concurrency=1)(self._admission)
        self.app.timer(interval=settings.reconcile_tick_s, name="reconcile")(self.timer.tick)
        self.app.task(self.presence_watch.run)
        # Started at the first assignment: faust starts app tasks only after the first recovery.
        self._recovery_watch: asyncio.Task[None] | None = None
        if settings.fault_stall_first_recovery:
            faust_adapter.stall_first_recovery_for_test(self.app)
        if settings.metrics_port:
            self.app.task(self._serve_metrics)
        self.app.on_partitions_assigned.connect(self._on_assigned)
        self.app.on_partitions_revoked.connect(self._on_revoked)

    # --- lifecycle --------------------------------------------------------------------------

    def _tune_runtime(self) -> None:
        """Run once when the agent starts (faust.Worker owns ``app.on_startup_finished``)."""
        # faust's built-in Monitor sensor records statistics on every message in and out; nothing
        # here reads them, and on two cores they cost a measurable share of each command.
        faust_adapter.remove_monitor_sensor(self.app)
        quiet_client_loggers()
        tune_gc(self.settings.gc_gen0_threshold)
        log.info("processor %s ready", self.settings.instance_id)

    async def _watch_recovery(self) -> None:
        """Restart a table recovery that stalled (faust_adapter.restart_stalled_recovery), for the life
        of the process from the first assignment."""
        last_restart: dict[Any, float] = {}
        while True:
            await asyncio.sleep(self.settings.recovery_check_s)
            try:
                restarted = await faust_adapter.restart_stalled_recovery(self.app, self.settings.recovery_stall_s, last_restart)
            except Exception as exc:  # noqa: BLE001 - mid-rebalance or stopping: the next check tries again
                log.warning("table recovery check failed (%s: %s)", type(exc).__name__, exc)
                continue
            for p in restarted:
                self.stats.recovery_restarts += 1
                log.warning(
                    "table recovery received nothing of %s[%d] for %.0f s (applied %d, needs %d; consumer position %s, "
                    "paused %s, read offset %s, flow active %s): sought again from %d",
                    p.topic, p.partition, self.settings.recovery_stall_s, p.offset, p.highwater, p.position,
                    p.paused, p.read_offset, p.flow_active, max(p.offset, 0),
                )

    async def _serve_metrics(self) -> None:
        """faust app task: ``/metrics`` in the app's loop for the life of the process (metrics_http.py)."""
        try:
            await start_metrics_server(
                self.metrics.registry, self.settings.metrics_port, host=self.settings.metrics_host, name="processor"
            )
        except MetricsPortUnavailable as exc:
            log.critical("%s; the processor stops", exc)
            await self.app.crash(exc)

    def assigned_command_partitions(self) -> set[int]:
        return faust_adapter.assigned_partitions(self.app, self.topology.commands.name)

    def partition_lag(self, assigned: set[int]) -> dict[int, int]:
        """Per assigned partition: commands in the log not yet decided here (high watermark - next offset)."""
        lag: dict[int, int] = {}
        for partition in assigned:
            expected = self._expected.get(partition)
            try:
                highwater = self.app.consumer.highwater(TP(self.topology.commands.name, partition))
            except Exception:  # noqa: BLE001 - not started, or mid-rebalance: no figure this scrape
                continue
            if highwater is not None and expected is not None:
                lag[partition] = max(0, highwater - expected)
        return lag

    async def _on_assigned(self, sender: Any, assigned: set[Any], **_: Any) -> None:
        if self._recovery_watch is None:
            self._recovery_watch = asyncio.get_running_loop().create_task(self._watch_recovery(), name="recovery-watch")
        self.timer.rescan_needed()
        mine = sorted(tp.partition for tp in assigned if tp.topic == self.topology.commands.name)
        # faust's recovery may start the stream while this runs: the agent waits for the offsets.
        self._expected_known.clear()
        try:
            self._expected = await self._committed_offsets(mine)
            try:
                self._recalled = await recall_read_stamps(
                    self._outside_reader(),
                    self.topology.ledger.name,
                    mine,
                    self.settings.stamp_recall_entries_max,
                    self.settings.gap_fill_timeout_s,
                )
                self._recall_error = None
            except Exception as exc:  # noqa: BLE001 - raised in the agent, which must not decide without them
                self._recall_error = exc
        finally:
            self._expected_known.set()

    async def _committed_offsets(self, partitions: list[int]) -> dict[int, int]:
        """Where delivery must resume on each partition: the group's committed offset, or the first
        offset kept when the group has none; {} when that cannot be read in time (the first command
        of each partition then goes unchecked)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        if not partitions:
            return {}
        tps = [TopicPartition(self.topology.commands.name, p) for p in partitions]
        # Not subscribed, so it never joins the group; it only reads the group's offsets.
        reader = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            group_id=self.topology.processor_app_id,
            enable_auto_commit=False,
            **kafka_client_kwargs(),
        )
        try:
            async with asyncio.timeout(self.settings.gap_fill_timeout_s):
                await reader.start()
                first = await reader.beginning_offsets(tps)
                resume = {}
                for tp in tps:
                    committed = await reader.committed(tp)
                    resume[tp.partition] = first[tp] if committed is None else max(committed, first[tp])
                return resume
        except Exception as exc:  # noqa: BLE001 - a check, not a precondition of processing
            log.warning("could not read the committed offsets at assignment: %r", exc)
            return {}
        finally:
            await reader.stop()

    def _outside_reader(self) -> Any:
        """An unstarted consumer outside the group, for reading a topic's records directly."""
        from aiokafka import AIOKafkaConsumer

        return AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # a start already removed by retention: from the first one kept
            **kafka_client_kwargs(),
        )

    async def _on_revoked(self, sender: Any, revoked: set[Any], **_: Any) -> None:
        lost = {tp.partition for tp in revoked if tp.topic == self.topology.commands.name}
        if lost:
            self.timer.forget(lost)
            self._decoded = {k: v for k, v in self._decoded.items() if user_partition(k, self.partitions) not in lost}
            self._unwritten = {k: v for k, v in self._unwritten.items() if user_partition(k, self.partitions) not in lost}
            for p in lost:
                self._expected.pop(p, None)
                self._recalled.pop(p, None)

    # --- the agent --------------------------------------------------------------------------

    async def _admission(self, stream: Any) -> None:
        self._tune_runtime()
        manual = stream.noack()  # acked by _drain, once the command's outputs are durable
        drainer = asyncio.ensure_future(self._drain(manual))
        try:
            async for event in manual.events():
                message = event.message
                partition, offset = message.partition, message.offset
                if not self._expected_known.is_set():
                    await self._expected_known.wait()
                if self._recall_error is not None:
                    # A command decided again without the stamp its first decision used could be
                    # decided otherwise under the same event ids: stop rather than guess.
                    raise RuntimeError("could not read the ledger's read stamps back at assignment") from self._recall_error
                if (partition, offset) in self._faults_skip:
                    self._faults_skip.discard((partition, offset))  # a test's fault: faust skipping it
                    continue
                expected = self._expected.get(partition)
                if expected is not None and offset > expected:
                    await self._fill_gap(partition, expected, offset, drainer)
                if expected is None or offset >= expected:
                    self._expected[partition] = offset + 1
                pending = await self.process(partition, offset, message.key, message.value, message.headers)
                pending.event = event
                await self._enqueue(pending, drainer)
        finally:
            drainer.cancel()

    async def _enqueue(self, pending: _Pending, drainer: asyncio.Future[Any]) -> None:
        """Hand a decided command to the drain task; wait while too many are in flight."""
        self._pending.append(pending)
        self._pending_added.set()
        while len(self._pending) >= self.settings.pending_commands_max and not drainer.done():
            self._pending_room.clear()
            await self._pending_room.wait()
        if drainer.done():
            drainer.result()  # re-raise why it stopped: the agent must not go on without it
            raise RuntimeError("the processor's drain task stopped")

    async def _fill_gap(self, partition: int, start: int, end: int, drainer: asyncio.Future[Any]) -> None:
        """Decide the commands at offsets [start, end) of a partition that faust did not deliver.

        faust-streaming 0.15.3 was seen skipping offsets of a partition right after a restart (kill -9
        under a backlog: offsets 169 and then 171 delivered, 170 never; 11 of 4,000 commands were
        never decided, about one run in ten on a loaded machine). The path inside faust was not
        pinned down; its commit bookkeeping also tolerates a one-offset hole at the committed offset
        (``Consumer._new_offset``), so it can commit past such a command. Every command of a
        partition must be decided, in order, so the skipped ones are read here straight from Kafka
        and decided before the one that revealed the hole; the offsets are then marked for faust's
        commit bookkeeping once their state is durable (in order, by ``_drain``). A redelivery of any of them later is
        answered from the aggregates' memory like any other redelivery."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self.stats.gaps += 1
        log.warning(
            "faust skipped offsets [%d, %d) of %s[%d]; reading them from Kafka",
            start, end, self.topology.commands.name, partition,
        )
        tp = TopicPartition(self.topology.commands.name, partition)
        reader = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # a start already removed by retention: from the first one kept
            **kafka_client_kwargs(),
        )
        patience = self.settings.gap_fill_timeout_s
        try:
            async with asyncio.timeout(patience):
                await reader.start()
            reader.assign([tp])
            reader.seek(tp, start)
            progress_at = time.monotonic()
            while True:
                async with asyncio.timeout(patience):
                    if await reader.position(tp) >= end:
                        break
                if time.monotonic() - progress_at > patience:
                    raise RuntimeError(
                        f"no record of the skipped offsets [{start}, {end}) of {tp} came in {patience} s "
                        "(CHATPLANE_PROCESSOR_GAP_FILL_TIMEOUT_S); the processor stops rather than skip them"
                    )
                batch = await reader.getmany(tp, timeout_ms=500, max_records=self.settings.gap_fill_batch_max)
                for record in batch.get(tp, ()):
                    if record.offset >= end:
                        break
                    progress_at = time.monotonic()
                    self.stats.gap_commands += 1
                    pending = await self.process(partition, record.offset, record.key, record.value, record.headers)
                    await self._enqueue(pending, drainer)
        finally:
            await reader.stop()
        await self._enqueue(_Pending(partition, skipped=(start, end - 1)), drainer)

    async def _drain(self, stream: Any) -> None:
        """Oldest first, a batch at a time: wait for the batch's ledger entries, then send its other
        outputs and wait for them, then write each command's state and ack it, in command order.

        Nothing but a ledger entry (or a dead letter) leaves before Kafka acknowledged the entry it
        derives from: a reply, a dispatch, a stop or a usage record of a decision whose entry was lost
        in a crash never existed. The batch is the head (whose entries are awaited) and every command
        behind it whose entries are already acknowledged, at most ``output_batch_max``: one wait for
        acknowledgements per batch, not per command."""
        pending = self._pending
        limit = self.settings.pending_commands_max
        batch_max = self.settings.output_batch_max
        try:
            while True:
                if not pending:
                    self._pending_added.clear()
                    await self._pending_added.wait()
                    continue
                self._fault("before-ledger-ack")
                for send in pending[0].sends:
                    await send  # raises when Kafka refused it after the producer's own retries
                size = 1
                while size < len(pending) and size < batch_max and all(_acknowledged(f) for f in pending[size].sends):
                    size += 1
                batch = [pending[i] for i in range(size)]
                for head in batch[1:]:
                    for send in head.sends:
                        await send  # done: raises if it failed
                self._fault("after-ledger-ack")
                out_sends: list[list[Awaitable[Any]]] = []
                for head in batch:
                    out_sends.append([
                        await faust_adapter.send_record(self.app, o.topic, o.key, o.value, o.partition, head.headers)
                        for o in head.outputs
                    ])
                for head, sends in zip(batch, out_sends):
                    for send in sends:
                        await send
                    pending.popleft()
                    await self._settle(head, stream)
                if len(pending) < limit:
                    self._pending_room.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # An output Kafka did not take: its state must not be written nor its command acked.
            log.critical("an output was not delivered; the processor stops: %r", exc)
            self._pending_room.set()
            await self.app.crash(exc)
            raise

    async def _settle(self, head: _Pending, stream: Any) -> None:
        """Every output of ``head`` is acknowledged: write its state, then ack its command."""
        writes = head.writes
        if writes is not None:
            await self._write(head.partition, writes)
            unwritten = self._unwritten.get(head.key)
            if unwritten is not None and unwritten[0] is head.aggregate:
                del self._unwritten[head.key]
                self._decoded[head.key] = (writes.puts[-1][1], head.aggregate, writes.layout)
        if head.decided_at:
            self.metrics.durable(time.perf_counter() - head.decided_at)
        if head.event is not None:
            await stream.ack(head.event)
        elif head.skipped is not None:
            # faust never saw these offsets: without this its commit stays behind them.
            first, last = head.skipped
            await faust_adapter.mark_offsets_handled(self.app, self.topology.commands.name, head.partition, first, last)

    def _fault(self, point: str) -> None:
        """A test's crash point (``CHATPLANE_FAULT_EXIT_AT``): exit as kill -9 would, no flush, no commit."""
        fault = self.settings.fault_exit_at
        if fault is None or fault[0] != point:
            return
        self._fault_batches += 1
        if self._fault_batches >= fault[1]:
            log.warning("fault injection: exiting at %s (batch %d)", point, self._fault_batches)
            logging.shutdown()
            os._exit(137)

    async def _write(self, partition: int, writes: TableWrites) -> None:
        """Settled entries, then the hot value, then deletes: any prefix reads back consistently.

        The changelog records go straight to the Kafka producer, not through faust's table buffer
        (``Table.send_changelog`` -> ``send_soon``): faust flushes that buffer before a commit but
        gives up after 0.1 s without a sent message (``ProducerBuffer.flush_atmost``), so under load
        an offset could be committed ahead of the state it implies. What is in the producer when the
        command is acked is flushed by the commit (aiokafka's ``flush`` waits for every batch). See
        ``faust_adapter.put_table_entry`` for what of faust this relies on."""
        app, table = self.app, self.table
        for key, value in writes.puts:
            await faust_adapter.put_table_entry(app, table, partition, key, value)
        for key in writes.deletes:
            await faust_adapter.delete_table_entry(app, table, partition, key)

    def _aggregate(self, key: bytes, user_id: str) -> tuple[Aggregate, Layout]:
        unwritten = self._unwritten.get(key)
        if unwritten is not None:
            return unwritten
        value = self.table.get(key)
        if value is None:
            return Aggregate.empty(user_id), EMPTY_LAYOUT
        cached = self._decoded.get(key)
        if cached is not None and cached[0] is value:
            return cached[1], cached[2]
        aggregate, layout = join(value, self.table.get, self.policy)
        self._decoded[key] = (value, aggregate, layout)
        return aggregate, layout

    async def process(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None, headers: Any = None
    ) -> _Pending:
        """Decide one command and send its outputs; the returned entry carries what to write once
        Kafka acknowledged them (see ``_drain``). A command whose ``headers`` carry a trace context
        gets a ``processor.decide`` span, whose context every output carries on (tracing.py)."""
        pending = _Pending(partition)
        if value is None:
            pending.sends.append(await self._dead_letter(partition, offset, key, b"", "empty message"))
            return pending
        try:
            command = decode_command(value)
        except WireError as exc:
            pending.sends.append(await self._dead_letter(partition, offset, key, value, exc.reason))
            return pending
        user_key = command.user_id.encode()
        if is_settled_key(user_key):
            # A user id that starts with NUL would share the settled entries' key space.
            reason = "user_id starts with NUL"
            pending.sends.append(await self._dead_letter(partition, offset, key, value, reason))
            return pending
        if key != user_key:
            # The single-writer guarantee needs every command of a user on the user's partition.
            reason = "message key is not the command's user_id"
            pending.sends.append(await self._dead_letter(partition, offset, key, value, reason))
            return pending
        if type(command) is SubmitGeneration and command.decide_by_ms:
            command = replace(command, read_at_ms=self._read_stamp(partition, command.command_id))
        started_ns = time.time_ns() if tracing.ENABLED else 0  # off: one flag check per command (tracing.py)
        started = time.perf_counter()
        try:
            before, layout = self._aggregate(user_key, command.user_id)
            after, decision, redelivered = handle(before, command, self.policy, offset)
            # A read (QueryUsage) returns the aggregate itself: nothing to store.
            unchanged = after is before
            if decision is not None and not redelivered and not unchanged:
                writes = plan(after, layout, self.policy)
                deadline = writes.deadline_ms
        except Exception as exc:  # noqa: BLE001 - a bug must not stop every user of the partition
            log.exception("processing %s failed", command.command_id)
            reason = f"processing error: {type(exc).__name__}"
            pending.sends.append(await self._dead_letter(partition, offset, key, value, reason))
            return pending
        self.stats.commands += 1
        if decision is None:
            # At or below the offset the durable state reflects: its outputs were acknowledged
            # before that state was written, so there is nothing to decide or send again.
            self.stats.redelivered_forgotten += 1
            return pending
        if redelivered:
            self.stats.redelivered += 1
        elif not unchanged:
            pending.key, pending.writes, pending.aggregate = user_key, writes, after
            self._unwritten[user_key] = (after, writes.layout)
            self.timer.decided(user_key, deadline, writes.readers)
        span = self._decision_span(headers, started_ns, command, decision, partition, offset) if started_ns else None
        out_headers = tracing.headers(span) if span is not None else None
        ledger_topic = self.topology.ledger.name
        for out in route(self.topology, before.ledger, after.ledger, command, decision, partition):
            if out.topic == ledger_topic:
                pending.sends.append(
                    await faust_adapter.send_record(self.app, out.topic, out.key, out.value, out.partition, out_headers)
                )
            else:
                pending.outputs.append(out)  # leaves once the ledger entry is acknowledged (_drain)
        pending.headers = out_headers
        if span is not None:
            tracing.end(span)
        pending.decided_at = time.perf_counter()
        self.metrics.decided(partition, command, before.ledger, after.ledger, decision, redelivered, pending.decided_at - started)
        return pending

    @staticmethod
    def _decision_span(headers: Any, started_ns: int, command: Any, decision: Any, partition: int, offset: int) -> Any:
        """The ``processor.decide`` span of a command that carries a trace context (None otherwise)."""
        outcome = decision.outcome
        return tracing.start(
            "processor.decide", tracing.extract(headers), start_ns=started_ns, command_type=command.type,
            command_id=command.command_id, generation_id=getattr(command, "generation_id", None) or outcome.generation_id,
            outcome=outcome.kind, code=outcome.code, partition=partition, offset=offset,
        )

    def _read_stamp(self, partition: int, command_id: str) -> int:
        """When this submit is read: now, or the stamp a decision of it already recorded on the ledger.

        The one clock reading a decision depends on (``decide`` refuses a submit read after its
        deadline); it goes into the command, and ``route`` records it on the ledger entry."""
        recalled = self._recalled.get(partition)
        stamp = recalled.get(command_id) if recalled else None
        return stamp if stamp is not None else int(time.time() * 1000)

    async def _dead_letter(
        self, partition: int, offset: int, key: bytes | None, value: bytes, reason: str
    ) -> Awaitable[Any]:
        self.stats.dead_lettered += 1
        log.warning("dead-lettered %s[%d]@%d: %s", self.topology.commands.name, partition, offset, reason)
        record = {
            "type": "DeadLetter",
            "schema_version": 1,
            "source_topic": self.topology.commands.name,
            "partition": partition,
            "offset": offset,
            "reason": reason,
            "key_b64": base64.b64encode(key or b"").decode(),
            "value_b64": base64.b64encode(value[:DEAD_LETTER_VALUE_BYTES_MAX]).decode(),
            "value_bytes": len(value),
        }
        return await faust_adapter.send_record(self.app, self.topology.dead_letter.name, key, encode(record), None)

    # --- what the timer reads and sends (timer.py) -------------------------------------------

    def _unwritten_aggregates(self) -> list[tuple[bytes, Aggregate]]:
        """(user key, aggregate) decided here and not yet written to the table."""
        return [(key, aggregate) for key, (aggregate, _) in self._unwritten.items()]

    def _aggregate_only(self, key: bytes, user_id: str) -> Aggregate:
        return self._aggregate(key, user_id)[0]

    def _send_command(self, key: bytes, value: bytes) -> Awaitable[Any]:
        """Append an encoded command to COMMANDS under ``key`` (the returned awaitable is the send)."""
        return faust_adapter.send_record(self.app, self.topology.commands.name, key, value, None)

    async def check_topology(self) -> None:
        """Co-partitioning, and a dispatch topic for every pool and tier of the catalog: a pool added to
        the catalog without ``infra/create-topics`` stops the processor here, not at its first dispatch."""
        await assert_copartitioned(self.settings.kafka_bootstrap, self.topology)
        pools = {m.pool for m in self.policy.models.values()}
        wanted = [self.topology.edge_presence, *(self.topology.dispatch(p, t) for p in sorted(pools) for t in TIERS)]
        await assert_topology(self.settings.kafka_bootstrap, wanted)


CLIENT_LOGGERS = ("aiokafka", "faust", "mode")


def quiet_client_loggers() -> None:
    """The Kafka client libraries log at debug level on every send; the worker's log set-up leaves
    that enabled, and building those records is a tenth of the processor's time."""
    level = max(logging.WARNING, logging.getLevelName(log_level("WARNING")))
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(level)


def main() -> None:
    try:
        level = log_level("WARNING")
        settings = ProcessorSettings()
        tracing.configure("chatplane-processor")
        use_event_loop()  # before faust creates its loop
    except SettingsError as exc:
        exit_on_settings_error(exc)
    tune_malloc()
    memtrace.maybe_start("processor")
    processor = AdmissionProcessor(settings)
    try:
        asyncio.run(processor.check_topology())
    except TopologyError as exc:
        raise SystemExit(f"projections: {exc}") from None
    worker = _Worker(processor.app, loglevel=level, quiet=True)
    worker.execute_from_commandline()


class _Worker(faust.Worker):
    """faust's worker, with the repeated-line bound on the root logger it configures, and no
    terminal spinner."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # faust's progress spinner writes terminal control sequences (cursor hide and show,
        # backspaces) to stdout whether or not it is a terminal, and the processor's stdout is its
        # log file (infra/component-start). Without a spinner faust logs its "Ready" line instead.
        self.spinner = None

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        # faust's public hook, called once the worker replaced the root logger's handlers.
        super().on_setup_root_logger(logger, level)
        install_log_limits(logger)


if __name__ == "__main__":
    main()
