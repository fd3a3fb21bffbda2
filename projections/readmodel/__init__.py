"""The read-model projection: the ledger -> Cassandra follower (``writer``, ``python -m projections.readmodel``)
and its metrics. The tables it writes, and the queries the edge runs on them, live in ``infra.stores``.
"""
