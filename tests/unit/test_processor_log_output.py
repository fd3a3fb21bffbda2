"""What the admission processor writes to its log file (var/log/projections.log under `make up`):
log lines only, no terminal control codes, and no recurring ERROR for a normal state.

Both are checked on an unstarted app and worker, without a broker: the worker's stdout is a
``StringIO`` (not a terminal, as the log file the component is started with), and the leader
assignor's start is what the app runs before its consumer subscribes.
"""

from __future__ import annotations

import io
import logging

import pytest

from projections.ledger.processor import AdmissionProcessor, _Worker
from projections.ledger.settings import ProcessorSettings
from infra.runtime.kafka_admin import deployment_topics

# ESC starts every terminal control sequence (colours, cursor hide/show); BS is the spinner's erase.
TERMINAL_CONTROL_CHARS = ("\x1b", "\b")


@pytest.fixture
def processor(monkeypatch) -> AdmissionProcessor:
    monkeypatch.setenv("CHATPLANE_NAMESPACE", "logcheck")
    return AdmissionProcessor(ProcessorSettings())


async def test_the_processors_worker_writes_no_terminal_control_codes_to_a_log_file(processor):
    out = io.StringIO()
    worker = _Worker(processor.app, loglevel="warning", quiet=True, stdout=out, stderr=out)
    # As after faust's logging set-up: a logger with one handler writing to the same file.
    logger = logging.getLogger("chatplane.test.processor-log-output")
    logger.addHandler(logging.StreamHandler(out))
    try:
        worker.on_setup_root_logger(logger, logging.WARNING)
        logger.warning("a warning while starting")  # a spinner would draw on every record
        await worker.on_startup_finished()
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
    written = out.getvalue()
    assert "a warning while starting" in written
    assert not any(c in written for c in TERMINAL_CONTROL_CHARS), repr(written)


async def test_the_processor_subscribes_to_no_topic_that_create_topics_does_not_make(processor):
    app = processor.app
    # The leader assignor is one of the app's services (faust.app.base); its start adds the leader
    # topic to the app's subscription unless leader election is off. Unstarted, nothing connects.
    await app._leader_assignor.on_start()
    made = {spec.name for spec in deployment_topics(processor.topology)}
    subscribed = {name for topic in app.topics for name in topic.topics}
    subscribed |= {*processor.commands.topics, processor.table.changelog_topic_name}
    assert subscribed - made == set(), "the processor would subscribe to topics nobody creates"
    assert not app.consumer.randomly_assigned_topics
