"""What every process runs on: settings, Kafka clients and admin, the command client, the metrics
server, tracing, log limits, GC and malloc tuning, memory snapshots."""
