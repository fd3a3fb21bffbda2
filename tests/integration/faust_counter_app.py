"""A tiny faust-streaming app for the foundation test: count events per user in a changelogged Table.

Run as a worker subprocess::

    python -m tests.integration.faust_counter_app worker -l info --without-web

(The worker CLI defaults to --with-web, which overrides web_enabled=False and binds 0.0.0.0:6066.)

Configured by environment (each test run uses its own app id and topics):
    CP_FAUST_APP_ID, CP_FAUST_BROKER (host:port), CP_FAUST_SOURCE, CP_FAUST_REPLIES,
    CP_FAUST_PARTITIONS, CP_FAUST_DATADIR.

For every event (key = user id, value = {"n": seq}) the agent increments ``counts[user]`` and
publishes {"user", "count", "n"} to the replies topic. The source and replies topics must exist;
faust creates only its own changelog (``<app id>-counts-changelog``) and assignor topics.
"""

from __future__ import annotations

import os

import faust

# Kafka's group.min.session.timeout.ms is 6 s: with the minimum, a kill -9'ed member is expelled
# quickly and the restarted worker gets its partitions without waiting the 60 s default.
SESSION_TIMEOUT_S = 6.0
HEARTBEAT_INTERVAL_S = 1.0
COMMIT_INTERVAL_S = 0.5

PARTITIONS = int(os.environ.get("CP_FAUST_PARTITIONS", "4"))

app = faust.App(
    os.environ.get("CP_FAUST_APP_ID", "cp-test-counter"),
    broker=f"kafka://{os.environ.get('CP_FAUST_BROKER', '127.0.0.1:9092')}",
    store="memory://",
    topic_partitions=PARTITIONS,
    topic_replication_factor=1,
    topic_allow_declare=True,  # only faust's internal topics (changelog, assignor) are declared
    table_standby_replicas=0,
    web_enabled=False,
    datadir=os.environ.get("CP_FAUST_DATADIR", None),
    broker_session_timeout=SESSION_TIMEOUT_S,
    broker_heartbeat_interval=HEARTBEAT_INTERVAL_S,
    broker_commit_interval=COMMIT_INTERVAL_S,
    consumer_auto_offset_reset="earliest",
)

source = app.topic(
    os.environ.get("CP_FAUST_SOURCE", "cp-test-events"),
    key_serializer="raw",
    value_serializer="json",
    partitions=PARTITIONS,
)
replies = app.topic(
    os.environ.get("CP_FAUST_REPLIES", "cp-test-replies"), key_serializer="raw", value_serializer="json"
)
counts = app.Table("counts", default=int, partitions=PARTITIONS)


@app.agent(source, concurrency=1)
async def count(stream):
    async for key, value in stream.items():
        user = key.decode()
        counts[user] += 1
        await replies.send(key=key, value={"user": user, "count": counts[user], "n": value["n"]})


if __name__ == "__main__":
    app.main()
