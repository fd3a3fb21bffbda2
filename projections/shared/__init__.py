"""The I/O layer every process shares: the command client, Kafka admin (topics), reading a topic,
the Cassandra bridge, the model catalog, token counting, settings and GC tuning.

It depends on ``schemas`` and ``control_plane`` only; the edge and the workers depend on it and on the
read side (``projections.readmodel``), never on the processor (``projections.ledger``).
"""
