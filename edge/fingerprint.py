"""HMAC fingerprint of the normalized request: what the core compares on a same-key retry.

Covers the messages (role and content, NFC-normalized), the model alias and ``max_output_tokens``;
not ``stream``, so a phone retry that switches response mode still identifies the same request. The
prompt itself never leaves the edge in a command: only this keyed digest does, so the commands and the
ledger, kept for days and for ever, hold no prompt text.
"""

from __future__ import annotations

import hashlib
import hmac
import unicodedata
from collections.abc import Sequence

import orjson

from schemas.messages import ChatMessage


def fingerprint(key: str, model_alias: str, messages: Sequence[ChatMessage], max_output_tokens: int) -> str:
    normalized = {
        "model": model_alias,
        "max_output_tokens": max_output_tokens,
        "messages": [[m.role, unicodedata.normalize("NFC", m.content)] for m in messages],
    }
    digest = hmac.new(key.encode(), orjson.dumps(normalized, option=orjson.OPT_SORT_KEYS), hashlib.sha256)
    return "hmac-sha256:" + digest.hexdigest()
