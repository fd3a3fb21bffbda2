"""The read side: the ledger -> Cassandra projection (``writer``, ``python -m projections.readmodel``),
the tables' DDL and session handling (``schema``), the queries the edge uses (``queries``), the result
store the workers write (``results``), and the analysts' usage report (``usage_report``).

Kept import-free so the edge and the workers can use ``queries`` / ``results`` without loading the writer.
"""
