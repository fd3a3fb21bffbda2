"""Cassandra: every table's reads and writes, grouped by the table's owner, and the one session a
process opens (``cassandra``). ``schema`` holds the read models' DDL and session settings; ``results``
the result rows the workers write; ``queries`` the edge's reads; ``replay`` the stream replay rows;
``history`` the conversations' content, sidebar index and spool.

Kept import-free so a process loads only the stores it uses.
"""
