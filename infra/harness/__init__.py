"""Process harnesses that start our components as real subprocesses against real Kafka/Cassandra,
shared by the tests and the benchmarks; it never imports ``tests``.

``processes`` (the processor, the edge, a projection and a worker as subprocesses, and the waits until
the processor decides or has committed), ``worker_edge`` (``TestEdge``, the edge's part for a worker run
in-process, with that worker's settings and catalog entry), ``models`` (the tests' catalog file and its
aliases), ``load`` (the chaos run's and the soak's client load) and ``chromium`` (headless Chromium for
the web page). The pytest fixtures that use them stay in ``tests/``.
"""
