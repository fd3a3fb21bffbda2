"""The admission processor and what belongs to it: the faust-streaming agent that runs the core on the
``commands`` topic (``processor``), its changelogged table layout (``table_store``), the one module that
reaches into faust-streaming's internals (``faust_adapter``), its settings, and the audit that replays
the ledger (``python -m projections.ledger.audit``).

Only ``python -m projections`` (the processor) and tools import this package; the edge and the
workers never do (tests/unit/test_imports.py).
"""
