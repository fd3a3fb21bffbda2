"""The conversation-history follower (``writer``, ``python -m projections.history``): it writes the
content of server-kept conversations from the ledger. The per-user ledger stays the authority for a
conversation's existence, revision and deletion; the tables are in ``infra.stores.history``; see
docs/conversations.md, Storage.
"""
