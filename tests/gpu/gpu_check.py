"""``infra/gpu-check``: on a host with an NVIDIA GPU and SGLang, check the ``sglang`` engine for real.

Part 1 (engine): starts the SGLang engine host (``python -m workers.engines.sglang``, its own process)
on a small local model and checks (a) streaming: several incremental chunks and a ``stop``/``length``
finish, (b) cancel: an abort mid-stream is acknowledged by the ``abort`` chunk within a few tokens,
(c) usage: ``prompt_tokens`` and ``completion_tokens`` from ``meta_info`` are positive and match the
chunks. Part 2 (end to end, when a Kafka broker answers at ``CHATPLANE_KAFKA_BOOTSTRAP``): the real
processor, a ``Worker`` on that engine and a test edge: a completed generation with usage and a
cancelled one. Exit status 0 only when every check that ran passed; it prints what it skipped.

    CHATPLANE_GPU_CHECK_MODEL=/path/to/small/model infra/gpu-check
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from schemas.codes import FinishReason
from workers.engines.base import EngineRequest, Finished, Message, TextChunk
from workers.engines.sglang import SGLangEngine, new_rid

CHECK_TIMEOUT_S = 300.0
ABORT_TOKENS_MAX = 4  # tokens allowed between the abort request and its acknowledgement


def fail(msg: str) -> None:
    print(f"gpu-check: FAIL: {msg}")
    sys.exit(1)


async def engine_checks(engine: SGLangEngine) -> None:
    req = EngineRequest(new_rid(), (Message("system", "You are a helpful assistant."), Message("user", "Name three colors.")), 64)
    chunks: list[TextChunk] = []
    fin: Finished | None = None
    async for item in engine.generate(req):
        if isinstance(item, Finished):
            fin = item
            break
        chunks.append(item)
    if fin is None or fin.reason not in (FinishReason.STOP, FinishReason.LENGTH):
        fail(f"stream did not finish normally: {fin}")
    if len(chunks) < 2:
        fail(f"expected several streamed chunks, got {len(chunks)}")
    if fin.input_tokens <= 0 or fin.output_tokens <= 0 or fin.output_tokens < chunks[-1].output_tokens:
        fail(f"usage from meta_info looks wrong: {fin}")
    print(f"gpu-check: stream ok: {len(chunks)} chunks, usage in={fin.input_tokens} out={fin.output_tokens}")

    req = EngineRequest(new_rid(), (Message("user", "Write a very long story about a dragon."),), 2000)
    gen = engine.generate(req)
    seen, at_abort, fin = 0, None, None
    t_abort = 0.0
    async for item in gen:
        if isinstance(item, Finished):
            fin = item
            break
        seen = item.output_tokens
        if seen >= 8 and at_abort is None:
            at_abort, t_abort = seen, time.monotonic()
            await gen.abort()
    if fin is None or fin.reason is not FinishReason.ABORTED or at_abort is None:
        fail(f"abort was not acknowledged by an abort chunk: {fin}")
    after = fin.output_tokens - at_abort
    if after > ABORT_TOKENS_MAX:
        fail(f"{after} tokens after the abort (at most {ABORT_TOKENS_MAX})")
    print(f"gpu-check: cancel ok: acknowledged {1000 * (time.monotonic() - t_abort):.1f} ms after abort, "
          f"{after} tokens after it, usage out={fin.output_tokens}")


GPU_ALIAS = "gpu-check-model"


def write_catalog(model_dir: Path, into: Path) -> Path:
    """A catalog naming the local SGLang model (its directory digest pinned), read by every process here."""
    from infra.models.catalog import weights_digest

    path = into / "models.toml"
    path.write_text(
        f'[models.{GPU_ALIAS}]\nversion = "gpu-check-model"\nengine = "sglang"\nweights = "{model_dir}"\n'
        f'weights_sha256 = "{weights_digest(model_dir)}"\ncontext_tokens = 4096\n'
        'system_instructions = "You are a helpful assistant."\n'
    )
    return path


async def end_to_end(engine: SGLangEngine, bootstrap: str, model_dir: Path) -> None:
    import tempfile

    from infra.models.catalog import load_catalog
    from infra.runtime.command_client import CommandClient
    from infra.runtime.kafka_admin import delete_topics, deployment_topics, ensure_topics
    from schemas.codes import RequestStatus
    from schemas.topics import Topology
    from infra.harness.processes import ProcessorProcess, wait_until_deciding
    from infra.harness.worker_edge import TestEdge, worker_settings
    from workers.worker import Worker

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    catalog_path = write_catalog(model_dir, work)
    os.environ["CHATPLANE_MODEL_CATALOG"] = str(catalog_path)  # the processor subprocess reads it too
    catalog = load_catalog(catalog_path)
    model = catalog.get(GPU_ALIAS)
    topo = Topology(f"gpu{uuid.uuid4().hex[:8]}")
    topics = deployment_topics(topo, catalog)
    await ensure_topics(bootstrap, topics)
    proc = ProcessorProcess(bootstrap, topo.namespace, work)
    proc.start()
    try:
        async with CommandClient(bootstrap, topo, inbox_partition=0, decision_timeout_s=15) as probe:
            await wait_until_deciding(probe)
        settings = worker_settings(bootstrap, topo, model_alias=GPU_ALIAS)
        async with TestEdge(bootstrap, topo, partition=1) as edge, Worker(settings, engine, model) as w:
            u = f"gpu-{uuid.uuid4().hex[:8]}"
            gid = await edge.submit(u, "Name three colors.", max_output_tokens=64, model_alias=GPU_ALIAS)
            final = await edge.wait_finalized(gid, 120)
            if final.status is not RequestStatus.COMPLETED or final.output_tokens <= 0 or not edge.deltas[gid]:
                fail(f"end-to-end generation: {final}")
            print(f"gpu-check: end to end ok: {len(edge.deltas[gid])} deltas, usage out={final.output_tokens}")
            u = f"gpu-{uuid.uuid4().hex[:8]}"
            gid = await edge.submit(u, "Write a very long story about a dragon.", max_output_tokens=2000, model_alias=GPU_ALIAS)
            await edge.wait_for(lambda: len(edge.deltas[gid]) >= 5, 120, "5 deltas")
            await edge.cancel(u, gid)
            final = await edge.wait_finalized(gid, 120)
            tr = w.traces[(gid, 1)]
            if final.status is not RequestStatus.CANCELLED or not final.partial:
                fail(f"end-to-end cancel: {final}")
            print(f"gpu-check: end-to-end cancel ok: {tr.tokens_after_stop} tokens after the stop, usage out={final.output_tokens}")
    finally:
        proc.stop()
        await delete_topics(bootstrap, [s.name for s in topics])


async def kafka_up(bootstrap: str) -> bool:
    host, _, port = bootstrap.partition(":")
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port or 9092)), 2)
        w.close()
        return True
    except (OSError, TimeoutError):
        return False


async def main() -> None:
    if shutil.which("nvidia-smi") is None:
        fail("no nvidia-smi: this check needs an NVIDIA GPU")
    try:
        import sglang  # noqa: F401
    except ImportError:
        fail("sglang is not installed (pip install 'sglang>=0.5,<0.6', the sglang extra)")
    model = os.environ.get("CHATPLANE_GPU_CHECK_MODEL")
    if not model or not Path(model).exists():
        fail("set CHATPLANE_GPU_CHECK_MODEL to a small local model directory (e.g. Qwen2.5-0.5B-Instruct)")
    engine = SGLangEngine({"model_path": model, "mem_fraction_static": 0.5, "log_level": "warning"})
    await engine.start()
    try:
        await asyncio.wait_for(engine_checks(engine), CHECK_TIMEOUT_S)
        bootstrap = os.environ.get("CHATPLANE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
        if await kafka_up(bootstrap):
            await asyncio.wait_for(end_to_end(engine, bootstrap, Path(model)), CHECK_TIMEOUT_S)
        else:
            print(f"gpu-check: end-to-end part skipped: no Kafka at {bootstrap} (infra/kafka-start)")
    finally:
        await engine.close()
    print("gpu-check: PASS")


if __name__ == "__main__":
    asyncio.run(main())
