"""Conversation history on Cassandra (DESIGN sections 5 and 9): the content of server-kept conversations.

The per-user ledger stays the authority for a conversation's existence, revision and deletion; this
package holds what the ledger never carries: the messages' text, the sidebar index and the edge's
spool of user turns. ``store`` has the tables and ``HistoryStore``; see docs/conversations.md, Storage.

Kept import-free so the edge and the workers load only what they use.
"""
