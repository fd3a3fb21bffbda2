"""The infrastructure adapters every process uses, beside the scripts that start the servers.

``runtime`` (settings, Kafka clients and admin, the command client, the metrics server, tracing, log
limits, GC/malloc tuning, memory snapshots), ``stores`` (every Cassandra table's reads and writes and one
session per process), ``models`` (the model catalog, the tokenizer, prompt framing) and ``content`` (the
content checks). Those depend on ``schemas`` and ``control_plane`` only; the processor, the
projections, the edge and the workers depend on them, never the other way. ``harness`` (the process
harnesses the tests and the benchmarks share), ``stack`` and ``k8s`` are tools: they may import any
product package, never ``tests``; ``harness`` runs from a checkout and is left out of the wheel.
"""
