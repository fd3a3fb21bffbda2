"""Cassandra: every table's reads and writes, grouped by the table's owner, and the one session a
process opens (``session``: opened on first use, one reopen policy); ``cassandra`` has the driver
helpers, ``schema`` the session settings (the tables' DDL is in ``schemas.tables``); ``results``
the result rows the workers write; ``queries`` the edge's reads; ``replay`` the stream replay rows;
``history`` the conversations' content, sidebar index and spool.

Kept import-free so a process loads only the stores it uses.
"""
