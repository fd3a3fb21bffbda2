"""The infrastructure adapters every process uses, beside the scripts that start the servers.

``runtime`` (settings, Kafka clients and admin, the command client, the metrics server, tracing, log
limits, GC/malloc tuning, memory snapshots), ``stores`` (every Cassandra table's reads and writes and one
session per process), ``models`` (the model catalog, the tokenizer, prompt framing) and ``content`` (the
content checks). It depends on ``schemas`` and ``control_plane`` only; the processor, the projections,
the edge and the workers depend on it, never the other way.
"""
