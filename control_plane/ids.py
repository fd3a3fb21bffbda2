"""Id derivation: the ids the core derives from a command, so every component derives the same one.

Pure: no I/O, no clock, no randomness. A redelivered or retried command names the same id, so the
edge can key a submit's prompt and trace by the generation id the processor will admit it under
(``generation_id_for``), and a same-key create names the same conversation (``conversation_id_for``).
"""

from __future__ import annotations

import base64
import hashlib


def conversation_id_for(user_id: str, idempotency_key: str) -> str:
    """A conversation's id, derived from its creator and the create request's Idempotency-Key: a
    same-key retry names the same conversation."""
    digest = hashlib.blake2b(f"{user_id}\x00{idempotency_key}".encode(), digest_size=12, person=b"chatplane-conv").digest()
    return "conv_" + base64.b32encode(digest).decode().lower().rstrip("=")


def generation_id_for(user_id: str, command_id: str) -> str:
    """A fixed-length id derived from the admitting command (fixed length: SGLang matches rids by prefix)."""
    digest = hashlib.blake2b(f"{user_id}\x00{command_id}".encode(), digest_size=10).digest()
    return "gen_" + base64.b32encode(digest).decode().lower()


__all__ = ["conversation_id_for", "generation_id_for"]
