"""``TestEdge``, standing in for the edge on one inbox partition, for a ``workers.Worker`` run
in-process against the real processor; and the settings and catalog entry such a worker runs with.

``TestEdge`` is what the edge does for a worker, and nothing more: it submits through the real
processor, keeps each generation's messages, answers ``PromptRequest`` with ``PromptPayload`` on the
worker's control partition (optionally held back until the caller releases it), and records every
``TextDelta`` and ``GenerationFinalized`` that arrives on its partition.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from typing import Any

from aiokafka import AIOKafkaProducer

from control_plane.ids import generation_id_for
from infra.harness.models import SIM_ALIAS
from infra.models.catalog import CatalogModel, load_catalog
from infra.runtime.command_client import CommandClient
from schemas import commands as cmd
from schemas.codes import Tier
from schemas.messages import ChatMessage, GenerationFinalized, PromptPayload, PromptPublished, PromptRequest, TextDelta
from schemas.topics import Topology
from schemas.wire import encode
from workers.settings import WorkerSettings

WAIT_S = 30.0
EDGE_DECISION_TIMEOUT_S = 15.0
PROMPT_PARK_S = 1.5
# Worker.traces kept by the tests' and benchmarks' workers (they read worker.traces[(gid, epoch)]).
ATTEMPT_TRACES_KEPT_MAX = 10_000


def now_ms() -> int:
    return int(time.time() * 1000)


class TestEdge:
    __test__ = False

    def __init__(self, bootstrap: str, topology: Topology, partition: int = 0) -> None:
        self.bootstrap, self.topology = bootstrap, topology
        self.client = CommandClient(bootstrap, topology, partition, on_message=self._on_message,
                                    decision_timeout_s=EDGE_DECISION_TIMEOUT_S)
        self.messages: dict[str, tuple[ChatMessage, ...]] = {}
        self.hold: dict[str, asyncio.Event] = {}  # generation -> released when the payload may go
        self.deltas: dict[str, list[TextDelta]] = defaultdict(list)
        self.first_delta_at: dict[str, float] = {}
        self.finalized: dict[str, GenerationFinalized] = {}
        self.prompt_requests: dict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()

    async def __aenter__(self) -> TestEdge:
        await self.client.start()
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=0)
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.producer.stop()
        await self.client.stop()

    def _on_message(self, message: Any) -> None:
        if isinstance(message, TextDelta):
            self.first_delta_at.setdefault(message.generation_id, time.monotonic())
            self.deltas[message.generation_id].append(message)
        elif isinstance(message, GenerationFinalized):
            self.finalized[message.generation_id] = message
        elif isinstance(message, PromptRequest):
            self.prompt_requests[message.generation_id] += 1
            task = asyncio.create_task(self._answer(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._changed.set()

    async def _answer(self, r: PromptRequest) -> None:
        # The dispatch can overtake the submit's decision: wait (bounded) until submit() stored the messages.
        deadline = time.monotonic() + PROMPT_PARK_S
        while r.generation_id not in self.messages and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        hold = self.hold.get(r.generation_id)
        if hold is not None:
            await hold.wait()
        found = r.generation_id in self.messages
        payload = PromptPayload(generation_id=r.generation_id, epoch=r.epoch, worker_id=r.worker_id, found=found,
                                messages=self.messages.get(r.generation_id, ()))
        await self.producer.send_and_wait(r.reply_to.topic, encode(payload), partition=r.reply_to.partition)

    async def submit(self, user: str, text: str = "Name three colors.", max_output_tokens: int = 64,
                     tier: Tier = Tier.FREE, hold: bool = False, model_alias: str = SIM_ALIAS,
                     publish: bool = False) -> str:
        """Submit for ``user``; with ``publish`` also publish the prompt on prompts.<pool> first, as the
        edge does (edge/routes/generations.py), so the worker need not ask for it."""
        command = cmd.SubmitGeneration(
            command_id=uuid.uuid4().hex, user_id=user, issued_at_ms=now_ms(), idempotency_key=uuid.uuid4().hex,
            fingerprint="fp-" + uuid.uuid4().hex[:12], model_alias=model_alias, tier=tier, stream=True,
            max_output_tokens=max_output_tokens, input_tokens=10, reply_to=self.client.reply_to(),
        )
        if publish:
            gid = generation_id_for(user, command.command_id)
            published = PromptPublished(generation_id=gid, user_id=user, published_at_ms=now_ms(),
                                        messages=(ChatMessage("user", text),))
            pool = load_catalog().get(model_alias).pool
            await self.producer.send_and_wait(self.topology.prompts(pool).name, encode(published), key=gid.encode())
        # The edge keeps the messages before the decision can arrive (the dispatch may race it).
        outcome = await self.client.decide(command)
        assert outcome.generation_id is not None, outcome
        gid = outcome.generation_id
        if hold:
            self.hold[gid] = asyncio.Event()
        self.messages[gid] = (ChatMessage("user", text),)
        return gid

    async def cancel(self, user: str, gid: str) -> Any:
        return await self.client.decide(cmd.CancelGeneration(
            command_id=uuid.uuid4().hex, user_id=user, issued_at_ms=now_ms(), generation_id=gid,
            reply_to=self.client.reply_to()))

    async def wait_for(self, predicate: Any, timeout_s: float = WAIT_S, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"timed out waiting for {what}"
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.2))
            except TimeoutError:
                pass

    async def wait_finalized(self, gid: str, timeout_s: float = WAIT_S) -> GenerationFinalized:
        await self.wait_for(lambda: gid in self.finalized, timeout_s, f"GenerationFinalized of {gid}")
        return self.finalized[gid]

    def text(self, gid: str) -> str:
        return "".join(d.text for d in self.deltas[gid])


def worker_settings(bootstrap: str, topology: Topology, **over: Any) -> WorkerSettings:
    base: dict[str, Any] = dict(
        kafka_bootstrap=bootstrap, topology=topology, worker_id=f"w-{uuid.uuid4().hex[:8]}",
        model_alias=SIM_ALIAS, heartbeat_interval_s=0.5, renew_interval_s=0.5, session_timeout_ms=6000,
        attempt_traces_max=ATTEMPT_TRACES_KEPT_MAX,
    )
    base.update(over)
    return WorkerSettings(**base)


def served(alias: str = SIM_ALIAS) -> CatalogModel:
    """The tests' catalog entry a worker serves (the simulator's unless a test names another alias)."""
    return load_catalog().get(alias)

