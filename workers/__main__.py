"""``python -m workers --engine cpu|sim|sglang``: one inference worker process (settings from the env).

Where it sits: reads ``dispatch.<pool>.{paid,free}`` and its worker-control partition, writes commands,
deltas to edge inboxes and heartbeats to ``capacity`` (see ``workers.worker``), and each final text to
the Cassandra result store before reporting completion (``workers.result_sink``; off with
``CHATPLANE_WORKER_RESULT_STORE=none``). SIGTERM/SIGINT drain
running attempts (bounded by ``DRAIN_TIMEOUT_S``) and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal

import orjson

from workers.engines.base import Engine
from workers.registry import RegisteredModel, default_registry
from projections.shared.settings import SettingsError, exit_on_settings_error
from workers.settings import WorkerSettings
from workers.worker import MissingTopics, NullResultSink, ResultSink, Worker


def build_engine(name: str, model: RegisteredModel) -> Engine:
    if name == "sim":
        from workers.engines.sim import SimConfig, SimulatedEngine

        return SimulatedEngine(SimConfig.from_env())
    if name == "cpu":
        from workers.engines.cpu import CpuEngine

        return CpuEngine(model.weights_path)
    if name == "sglang":
        from workers.engines.sglang import SGLangEngine

        args = orjson.loads(os.environ.get("CHATPLANE_SGLANG_ENGINE_ARGS", "{}"))
        if os.environ.get("CHATPLANE_SGLANG_MODEL_PATH"):
            args.setdefault("model_path", os.environ["CHATPLANE_SGLANG_MODEL_PATH"])
        return SGLangEngine(args)
    raise SystemExit(f"unknown engine {name!r}: cpu, sim or sglang")


def served_model(settings: WorkerSettings, engine: str) -> RegisteredModel:
    model = default_registry().get(settings.model_alias)
    override = os.environ.get("CHATPLANE_WORKER_MODEL_VERSION")
    return dataclasses.replace(model, engine=engine, version=override or model.version)


def build_result_sink(settings: WorkerSettings) -> ResultSink:
    """The Cassandra result store unless ``CHATPLANE_WORKER_RESULT_STORE=none`` (opened lazily, bounded per put)."""
    if settings.result_store == "none":
        return NullResultSink()
    from projections.readmodel.schema import ReadModelSettings
    from workers.result_sink import CassandraResultSink

    # The store opens lazily; its settings (CHATPLANE_CASSANDRA_*) are read now, so a bad value stops the start.
    return CassandraResultSink(
        ReadModelSettings(),
        attempts_max=settings.result_put_attempts_max,
        backoff_s=settings.result_put_backoff_s,
        deadline_s=settings.result_put_deadline_s,
    )


async def amain(engine_name: str) -> None:
    settings = WorkerSettings()
    model = served_model(settings, engine_name)
    sink = build_result_sink(settings)
    worker = Worker(settings, build_engine(engine_name, model), model, result_sink=sink)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A signal during start-up (a broker that does not answer yet) stops it too.
    starting = asyncio.create_task(worker.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    try:
        if starting.done():
            starting.result()  # raises MissingTopics & co.
            await stopping
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
    finally:
        stopping.cancel()
        await worker.stop()
        close = getattr(sink, "close", None)
        if close is not None:
            await close()


def main() -> None:
    parser = argparse.ArgumentParser(description="chatplane inference worker")
    parser.add_argument("--engine", default=os.environ.get("CHATPLANE_WORKER_ENGINE", "cpu"), choices=("cpu", "sim", "sglang"))
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("CHATPLANE_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        asyncio.run(amain(args.engine))
    except SettingsError as exc:  # a CHATPLANE_* variable of the worker or of its engine
        exit_on_settings_error(exc)
    except MissingTopics as exc:
        raise SystemExit(f"workers: {exc}") from None


if __name__ == "__main__":
    main()
