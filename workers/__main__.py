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
import logging
import signal
from pathlib import Path
from typing import Any, assert_never

import orjson

from infra.models.catalog import (
    ENGINES_WITH_WEIGHTS,
    CatalogError,
    CatalogModel,
    EngineKind,
    ModelFileMissing,
    UnknownModel,
    WeightsMismatch,
    load_catalog,
)
from workers.engines.base import Engine
from infra.runtime import memtrace, tracing
from infra.runtime.malloc_tuning import tune_malloc
from infra.runtime.log_limits import install_log_limits
from infra.content.policy_checks import PolicySettings, load_policy_check
from infra.runtime.event_loop import use_event_loop
from infra.runtime.settings import SettingsError, env_value, exit_on_settings_error, log_level
from infra.runtime.metrics_http import MetricsPortUnavailable, start_metrics_server
from infra.stores.schema import ReadModelSettings
from infra.stores.session import CassandraSession
from workers.metrics import WorkerMetrics
from workers.replay_sink import CassandraReplaySink, NullReplaySink, ReplaySink
from workers.result_sink import CassandraResultSink
from workers.settings import WorkerSettings
from workers.worker import MissingTopics, NullResultSink, ResultSink, Worker


def _json_object(raw: str) -> dict[str, Any]:
    value = orjson.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


class ServeRefused(RuntimeError):
    """This worker cannot serve the alias it was started for; the message is one line."""


def build_engine(model: CatalogModel, weights: Path | None) -> Engine:
    """The catalog's engine for ``model`` (``weights``: verified against the pinned digest)."""
    match model.engine:
        case EngineKind.SIM:
            # deferred: a worker loads only the engine its catalog alias names (sim: the simulator aliases)
            from workers.engines.sim import SimConfig, SimulatedEngine

            return SimulatedEngine(SimConfig.from_env())
        case EngineKind.CPU:
            # deferred: the cpu engine needs the optional llama-cpp-python (the cpu extra)
            from workers.engines.cpu import CpuEngine, PromptIdsLog

            assert weights is not None
            return CpuEngine(weights, context_tokens=model.context_tokens, prompt_ids_log=PromptIdsLog.from_env())
        case EngineKind.SGLANG:
            # deferred: the sglang engine needs the optional sglang (the sglang extra, a GPU host)
            from workers.engines.sglang import SGLangEngine

            assert weights is not None
            args = dict(env_value("CHATPLANE_SGLANG_ENGINE_ARGS", {}, parse=_json_object, expected="a JSON object"))
            args["model_path"] = str(weights)
            return SGLangEngine(args)
        case _:
            assert_never(model.engine)


def served_model(settings: WorkerSettings, engine: str | None) -> tuple[CatalogModel, Path | None]:
    """The catalog entry this worker serves and its verified weights, or ``ServeRefused``.

    An engine other than the catalog's for the alias refuses to start (a simulator only serves a
    simulator alias), and so do weights whose sha256 is not the pinned one: a worker never answers a
    dispatch for a version it does not hold.
    """
    catalog = load_catalog()
    try:
        model = catalog.get(settings.model_alias)
    except UnknownModel:
        raise ServeRefused(
            f"model alias {settings.model_alias!r} (CHATPLANE_WORKER_MODEL_ALIAS) is not in the catalog {catalog.source}"
        ) from None
    if engine is not None and engine != model.engine.value:
        raise ServeRefused(
            f"engine {engine!r} cannot serve {model.alias}: the catalog {catalog.source} serves it with "
            f"{model.engine.value!r} ({model.version})"
        )
    if model.engine not in ENGINES_WITH_WEIGHTS:
        return model, None
    try:
        return model, model.verify_weights()
    except (ModelFileMissing, WeightsMismatch) as exc:
        raise ServeRefused(str(exc)) from None


def build_cassandra(settings: WorkerSettings) -> CassandraSession | None:
    """The worker's one Cassandra session (opened on first use), shared by its result and replay
    sinks; None when ``CHATPLANE_WORKER_RESULT_STORE=none`` (neither stores anything)."""
    if settings.result_store == "none":
        return None
    # The session opens lazily; its settings (CHATPLANE_CASSANDRA_*) are read now, so a bad value stops the start.
    return CassandraSession(ReadModelSettings())


def build_result_sink(settings: WorkerSettings, cassandra: CassandraSession | None = None) -> ResultSink:
    """The Cassandra result store unless ``CHATPLANE_WORKER_RESULT_STORE=none`` (opened lazily, bounded per
    put), on ``cassandra`` (else on a session of its own)."""
    if settings.result_store == "none":
        return NullResultSink()
    # The store opens lazily; its settings (CHATPLANE_CASSANDRA_*) are read now, so a bad value stops the start.
    return CassandraResultSink(
        ReadModelSettings() if cassandra is None else cassandra.settings,
        cassandra=cassandra,
        attempts_max=settings.result_put_attempts_max,
        backoff_s=settings.result_put_backoff_s,
        deadline_s=settings.result_put_deadline_s,
        pending_max=settings.result_pending_max,
        pending_bytes_max=settings.result_pending_bytes_max,
        pending_age_max_s=settings.result_pending_age_max_s,
        retry_interval_s=settings.result_retry_interval_s,
    )


def build_replay_sink(settings: WorkerSettings, cassandra: CassandraSession | None = None) -> ReplaySink:
    """Deltas stored for replay (workers/replay_sink.py) unless ``CHATPLANE_WORKER_REPLAY_STORE`` or
    ``CHATPLANE_WORKER_RESULT_STORE`` is ``none``, on ``cassandra`` (else on a session of its own)."""
    if settings.result_store == "none" or settings.replay_store == "none":
        return NullReplaySink()
    return CassandraReplaySink(ReadModelSettings() if cassandra is None else cassandra.settings, cassandra=cassandra)


async def amain(engine_name: str | None) -> None:
    settings = WorkerSettings()
    model, weights = served_model(settings, engine_name)
    cassandra = build_cassandra(settings)  # one session for both sinks
    sink = build_result_sink(settings, cassandra)
    replay = build_replay_sink(settings, cassandra)
    # The output check between decode steps (docs/policy.md), loaded once; a bad list stops the worker.
    policy = PolicySettings()
    metrics = WorkerMetrics()  # served on CHATPLANE_WORKER_METRICS_PORT (docs/metrics.md)
    worker = Worker(
        settings, build_engine(model, weights), model, result_sink=sink, replay_sink=replay,
        policy_check=load_policy_check(policy) if policy.output else None, on_trace=metrics.observe_attempt,
    )
    metrics.bind(worker, sink)
    metrics_server = await start_metrics_server(
        metrics.registry, settings.metrics_port, host=settings.metrics_host, name="worker"
    )
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
        if metrics_server is not None:
            await metrics_server.close()
        for closeable in (sink, replay):
            close = getattr(closeable, "close", None)
            if close is not None:
                await close()
        if cassandra is not None:
            await cassandra.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="chatplane inference worker")
    engines = [e.value for e in EngineKind]
    try:
        engine_default = env_value("CHATPLANE_WORKER_ENGINE", None, kind=str, choices=engines)
        level = log_level("INFO")
        tracing.configure("chatplane-worker")
        use_event_loop()
    except SettingsError as exc:
        exit_on_settings_error(exc)
    parser.add_argument(
        "--engine", default=engine_default, choices=engines,
        help="must be the catalog's engine for the alias (default: CHATPLANE_WORKER_ENGINE, else the catalog's)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    install_log_limits()
    tune_malloc()
    memtrace.maybe_start("worker")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        asyncio.run(amain(args.engine))
    except SettingsError as exc:  # a CHATPLANE_* variable of the worker or of its engine
        exit_on_settings_error(exc)
    except (MissingTopics, ServeRefused, CatalogError, MetricsPortUnavailable) as exc:
        raise SystemExit(f"workers: {exc}") from None


if __name__ == "__main__":
    main()
