"""The worker's pull order between the paid and free dispatch topics (``Worker._preferred_tier``), its
settled-offset bookkeeping (``_OffsetTracker``) and its bounded append of a command no answer is awaited
for (``Worker.append``); no broker: nothing here connects."""

from __future__ import annotations

from aiokafka import TopicPartition

from schemas.topics import Topology
from workers.engines.sim import SimConfig, SimulatedEngine
from infra.harness.worker_edge import served
from workers.settings import WorkerSettings
from workers.worker import Worker, _OffsetTracker


def worker(paid_weight: int, free_min_share: float) -> Worker:
    settings = WorkerSettings(kafka_bootstrap="127.0.0.1:1", topology=Topology("unit"), worker_id="w-unit",
                              paid_weight=paid_weight, free_min_share=free_min_share)
    return Worker(settings, SimulatedEngine(SimConfig()), served())


def take(w: Worker, n: int) -> list[str]:
    order = []
    for _ in range(n):
        tier = w._preferred_tier()
        w._taken[tier] += 1
        order.append(tier)
    return order


def test_paid_is_preferred_by_its_weight_when_both_tiers_have_work():
    order = take(worker(paid_weight=3, free_min_share=0.0), 400)
    assert order[:4] == ["paid", "paid", "paid", "free"]
    assert 0.74 <= order.count("paid") / len(order) <= 0.76


def test_free_never_falls_below_its_minimum_share():
    order = take(worker(paid_weight=20, free_min_share=0.25), 400)
    assert order.count("free") / len(order) >= 0.25
    # ... and the share holds over every window once started, not only on average.
    for i in range(40, 400, 40):
        assert order[:i].count("free") / i >= 0.24


def test_offsets_are_committed_only_below_the_oldest_unsettled_dispatch():
    tp = TopicPartition("dispatch", 0)
    t = _OffsetTracker()
    for offset in (10, 11, 12):
        t.begin(tp, offset)
    assert t.done(tp, 11) == 10  # 10 is still being prepared: nothing past it is committed
    assert t.done(tp, 10) == 12
    assert t.done(tp, 12) == 13


class _InstantProducer:
    """Stands in for the producer: accepts every send at once (the decision then comes from the test)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None]] = []

    async def send_and_wait(self, topic, value, key=None, partition=None, headers=None):
        self.sent.append((topic, key))
        return None


async def test_a_decision_wait_cancelled_as_its_answer_arrives_is_still_cancelled():
    """A renewer is cancelled when its attempt ends; if its answer lands in the same loop turn, Python
    3.11's ``asyncio.wait_for`` returned the answer instead and the renewer lived on (the attempt then
    waited for it forever). ``decide`` must raise ``CancelledError``. The worker appends through the
    command client, which keys the command by its user id."""
    import asyncio
    import uuid

    import pytest

    from infra.runtime.command_client import CommandClient
    from schemas import commands as cmd
    from schemas.messages import Outcome, OutcomeKind

    w = worker(paid_weight=3, free_min_share=0.2)
    producer = _InstantProducer()
    # As Worker.start() wires it, on the instant producer.
    w.commands = CommandClient(w.settings.kafka_bootstrap, w.settings.topology, w.control.partition,
                               inbox_topic=w.control.topic, producer=producer, read_inbox=False)  # type: ignore[arg-type]
    command = cmd.RenewLease(command_id=uuid.uuid4().hex, user_id="u", issued_at_ms=0, generation_id="gen_x",
                             epoch=1, worker_id="w-unit", reply_to=w.reply_to(), output_tokens=0)
    task = asyncio.create_task(w.decide(command))
    for _ in range(10):
        await asyncio.sleep(0)
        if w.commands.pending:
            break
    assert producer.sent == [(w.settings.topology.commands.name, b"u")]
    w.commands.resolve(Outcome(command_id=command.command_id, kind=OutcomeKind.APPLIED))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class _RecordingProducer:
    """Stands in for the producer: records every send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.arrived = None

    async def send_and_wait(self, topic, value, key=None, partition=None, headers=None):
        self.sent.append((topic, value))
        if self.arrived is not None:
            self.arrived.set()
        return None


async def test_a_freed_slot_is_announced_by_a_heartbeat_at_once_not_at_the_next_interval():
    """With one slot, an edge that still sees the last "0 free" heartbeat refuses the next request
    with capacity_exhausted; so a slot change sends a heartbeat at once (bounded by the min interval)."""
    import asyncio
    import contextlib

    from schemas.messages import WorkerHeartbeat
    from schemas.wire import decode_message

    settings = WorkerSettings(kafka_bootstrap="127.0.0.1:1", topology=Topology("unit"), worker_id="w-unit",
                              heartbeat_interval_s=3600.0, heartbeat_min_interval_s=0.0, slots=1)
    w = Worker(settings, SimulatedEngine(SimConfig()), served())
    producer = _RecordingProducer()
    producer.arrived = asyncio.Event()
    w.producer = producer  # type: ignore[assignment]
    loop = asyncio.create_task(w._heartbeat_loop())
    try:
        async def next_heartbeat() -> WorkerHeartbeat:
            producer.arrived.clear()
            async with asyncio.timeout(30):  # an hour-long interval: only the change can send it
                await producer.arrived.wait()
            hb = decode_message(producer.sent[-1][1])
            assert isinstance(hb, WorkerHeartbeat)
            return hb

        assert (await next_heartbeat()).free_slots == 1
        w.free_slots -= 1  # what the dispatch loop does when it takes a dispatch
        w._capacity_changed.set()
        assert (await next_heartbeat()).free_slots == 0
        w.free_slot(None)
        assert (await next_heartbeat()).free_slots == 1
        assert len(producer.sent) == 3
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


class _FailingProducer:
    """Stands in for the producer: the first ``failures`` sends raise a KafkaError (or, with ``hang``,
    never return); then every send is acknowledged."""

    def __init__(self, failures: int, hang: bool = False) -> None:
        self.failures, self.hang, self.tries = failures, hang, 0

    async def send_and_wait(self, topic, value, key=None, partition=None, headers=None):
        import asyncio

        from aiokafka.errors import KafkaTimeoutError

        self.tries += 1
        if self.tries <= self.failures:
            if self.hang:
                await asyncio.Event().wait()
            raise KafkaTimeoutError()
        return None


async def test_a_report_is_appended_with_no_reply_and_its_failures_retried_a_bounded_number_of_times(
    monkeypatch, caplog
):
    """The report goes without ``reply_to``: the worker waits only for Kafka's acknowledgement. A send
    that fails or hangs is tried again, at most ``decision_attempts_max`` times, each try bounded by
    ``decision_timeout_s``; then it gives up and says so."""
    import uuid

    from infra.runtime.command_client import CommandClient
    from schemas import commands as cmd
    from schemas.codes import FinishOutcome
    from workers import worker as worker_module

    monkeypatch.setattr(worker_module, "APPEND_RETRY_BACKOFF_S", 0.0)
    settings = WorkerSettings(kafka_bootstrap="127.0.0.1:1", topology=Topology("unit"), worker_id="w-unit",
                              decision_attempts_max=3, decision_timeout_s=0.05)

    def report() -> cmd.ReportAttemptFinished:
        return cmd.ReportAttemptFinished(
            command_id=uuid.uuid4().hex, user_id="u", issued_at_ms=0, generation_id="gen_x", epoch=1,
            worker_id="w-unit", outcome=FinishOutcome.COMPLETED, input_tokens=1, output_tokens=2, reply_to=None,
        )

    for producer, appended, tries in (
        (_FailingProducer(2), True, 3),  # two failures, then acknowledged
        (_FailingProducer(2, hang=True), True, 3),  # two hung sends, each cut at the decision timeout
        (_FailingProducer(10), False, 3),  # never acknowledged: given up after three tries
    ):
        w = Worker(settings, SimulatedEngine(SimConfig()), served())
        w.commands = CommandClient(settings.kafka_bootstrap, settings.topology, w.control.partition,
                                   inbox_topic=w.control.topic, producer=producer, read_inbox=False)  # type: ignore[arg-type]
        caplog.clear()
        assert await w.append(report()) is appended
        assert producer.tries == tries
        gave_up = [r.getMessage() for r in caplog.records if "not appended after" in r.getMessage()]
        assert len(gave_up) == (0 if appended else 1), gave_up
        assert all(m.startswith("ReportAttemptFinished of gen_x epoch 1 ") and m.endswith("after 3 tries") for m in gave_up)
