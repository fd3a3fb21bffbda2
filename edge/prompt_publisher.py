"""Prompts from this edge to the workers: the only path a prompt's content takes to a worker.

Data flow::

    POST (edge.routes.generations)  --publish(topic, id, user, messages)-->  PromptPublished on
        chatplane.prompts.<pool>, keyed by the generation id the submit will have (so it lands in
        the partition of the pool's dispatch topics its dispatch will: schemas/topics.py
        prompts_topic); counted in ``prompts_published{sent}``
    PromptRequest (a worker found none; edge inbox --> StreamHub, which looks up the stream)
        --answer(request, messages or None)-->  PromptPayload to the worker's control partition
        (``request.reply_to``), keyed by the worker id; counted in ``prompt_requests{found}``

Both sends are best effort and run in the background (edge/background.py, its bound shared with the
other background sends): a worker that does not find a published prompt asks this edge for it, and
one that gets no answer lets the processor's deadlines settle the generation. The producer is the
edge's (set by ``start`` when the edge starts); this unit holds no buffer of its own.
"""

from __future__ import annotations

import time

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from edge.background import BackgroundSends
from edge.metrics import EdgeMetrics
from schemas.messages import ChatMessage, PromptPayload, PromptPublished, PromptRequest
from schemas.wire import encode


class PromptPublisher:
    """Sends prompts to the workers on the edge's producer, in the background."""

    def __init__(self, metrics: EdgeMetrics, background: BackgroundSends) -> None:
        self.metrics = metrics
        self.background = background
        self.producer: AIOKafkaProducer | None = None

    def start(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer

    def publish(self, topic: str, generation_id: str, user_id: str, messages: tuple[ChatMessage, ...]) -> None:
        """Publish a submit's prompt beside it, keyed by the generation id it will have (so it lands in
        the partition of the pool's dispatch topics its dispatch will: schemas/topics.py prompts_topic).
        Best effort, in the background: a worker that does not find it asks this edge for it."""
        message = PromptPublished(
            generation_id=generation_id, user_id=user_id, published_at_ms=int(time.time() * 1000), messages=messages
        )
        self.background.spawn(self._publish(topic, message))

    def answer(self, request: PromptRequest, messages: tuple[ChatMessage, ...] | None) -> None:
        """Answer a worker's ``PromptRequest``: ``messages`` if this edge holds the generation's
        stream at the request's epoch (still going), None if not (``found=False``)."""
        found = messages is not None
        self.metrics.prompt_requests.labels(str(found).lower()).inc()
        payload = PromptPayload(
            generation_id=request.generation_id,
            epoch=request.epoch,
            worker_id=request.worker_id,
            found=found,
            messages=messages if messages is not None else (),
        )
        self.background.spawn(self._send_payload(request, payload))

    async def _publish(self, topic: str, message: PromptPublished) -> None:
        assert self.producer is not None
        try:
            await self.producer.send_and_wait(topic, encode(message), key=message.generation_id.encode())
        except KafkaError:
            self.metrics.prompts_published.labels("false").inc()
            raise
        self.metrics.prompts_published.labels("true").inc()

    async def _send_payload(self, request: PromptRequest, payload: PromptPayload) -> None:
        assert self.producer is not None
        await self.producer.send_and_wait(
            request.reply_to.topic, encode(payload), key=request.worker_id.encode(), partition=request.reply_to.partition
        )
