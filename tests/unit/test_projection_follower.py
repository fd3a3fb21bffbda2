"""The process the ledger's followers share (projections/follower.py): exit codes, what is closed on
each path, the commit after a batch; and the history writer's commands, sent through the shared
command client (infra/runtime/command_client.py), which keys them.

The followers themselves against Kafka and Cassandra: tests/integration/test_readmodel*.py,
tests/integration/test_history_store.py, tests/integration/test_metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaConnectionError

from infra.runtime.command_client import CommandClient
from projections.follower import (
    EXIT_KAFKA,
    EXIT_OK,
    EXIT_STALLED,
    ConsumerMetrics,
    commit_offsets,
    follower_group,
    run_follower,
)
from projections.history.metrics import history_metrics
from projections.history.writer import HistoryWriter
from projections.readmodel.metrics import readmodel_metrics
from schemas.commands import CommitAnswer
from schemas.topics import Topology
from schemas.wire import decode_command

log = logging.getLogger("test.follower")


class Stalled(RuntimeError):
    pass


class FakeFollower:
    def __init__(self, fails: BaseException | None = None) -> None:
        self.fails = fails
        self.stats = SimpleNamespace(positions={})
        self.consumer = None
        self.group_id = "g"
        self.calls: list[str] = []

    def stop(self) -> None:
        self.calls.append("stop")

    async def start(self) -> None:
        self.calls.append("start")

    async def run(self) -> None:
        self.calls.append("run")
        if self.fails is not None:
            raise self.fails

    async def close(self) -> None:
        self.calls.append("close")


@pytest.mark.parametrize(
    ("fails", "code"), [(None, EXIT_OK), (Stalled("no store"), EXIT_STALLED), (KafkaConnectionError(), EXIT_KAFKA)]
)
async def test_a_follower_process_runs_closes_and_exits_with_its_code(fails, code, capsys):
    follower, closed = FakeFollower(fails), []

    async def close_store() -> None:
        closed.append(follower.calls[-1])  # after the follower closed

    loop = asyncio.get_running_loop()
    try:
        got = await run_follower(
            follower, name="fake", label="fake follower", metrics=ConsumerMetrics("chatplane_fake", (), {}),
            metrics_port=0, stalled=Stalled, started="fake started", log=log, close_also=close_store,
        )
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    assert got == code
    assert follower.calls == ["start", "run", "close"] and closed == ["close"]
    assert "fake: started" in capsys.readouterr().out


async def test_a_commit_refused_after_a_rebalance_is_logged_and_the_positions_still_move(caplog):
    class Consumer:
        async def commit(self, offsets):
            raise CommitFailedError("rebalanced")

    tp = TopicPartition("ledger", 0)
    positions: dict[TopicPartition, int] = {}
    with caplog.at_level(logging.WARNING, logger="test.follower"):
        await commit_offsets(Consumer(), {tp: 7}, positions, log)  # type: ignore[arg-type]
    assert positions == {tp: 7} and "offset commit failed after a rebalance" in caplog.text


def test_group_names_and_metric_names_are_unchanged():
    assert follower_group("", "chatplane-history") == "chatplane-history"
    assert follower_group("ns", "chatplane-readmodel") == "ns.chatplane-readmodel"
    topology = Topology("ns")
    assert history_metrics(topology).prefix == "chatplane_history"
    assert readmodel_metrics(topology).prefix == "chatplane_readmodel"
    assert history_metrics(topology).sources == {topology.ledger.name: "ledger", topology.answers.name: "answers"}


class RecordingProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None]] = []

    async def send_and_wait(self, topic, value, key=None, headers=None, **_):
        self.sent.append((topic, value, key))


async def test_the_history_writer_sends_commit_answer_through_the_command_client_keyed_by_the_user():
    topology = Topology("ns")
    writer = HistoryWriter("127.0.0.1:1", topology, store=None, group_id=None)  # type: ignore[arg-type]
    assert isinstance(writer.commands, CommandClient) and not writer.commands.read_inbox
    assert writer.group_id == "ns.chatplane-history"
    producer = RecordingProducer()
    writer.commands._producer = producer  # type: ignore[assignment]  # started by start(); not here
    command = CommitAnswer(command_id="commit-g-1-x", user_id="u-7", issued_at_ms=1, conversation_id="c-1",
                           generation_id="g", epoch=1)
    await writer._send(command)
    [(topic, value, key)] = producer.sent
    assert topic == topology.commands.name and key == b"u-7" and decode_command(value) == command
