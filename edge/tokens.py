"""Input-token counting for the edge's bound, behind one small interface: ``counter(alias, messages)``.

The count is the model's own (``infra.models.tokens.count_input_tokens`` over the catalog
entry: its tokenizer and its trusted system instructions, which the worker installs), so the
``input_tokens`` of a command is the same figure a worker would count. For an alias the catalog does
not know (the route refuses those as ``model_not_found`` before counting; the counter still answers)
the edge uses its own conservative estimate: UTF-8 bytes / 3 rounded up per message plus a
per-message framing overhead (ChatML adds about 4 tokens per message).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from infra.models.catalog import Catalog, UnknownModel
from infra.models.tokens import count_input_tokens
from schemas.messages import ChatMessage

ESTIMATE_BYTES_PER_TOKEN = 3
MESSAGE_FRAMING_TOKENS = 4
PROMPT_FRAMING_TOKENS = 3

Counter = Callable[[str, Sequence[ChatMessage]], int]


def estimate_input_tokens(model_alias: str, messages: Sequence[ChatMessage]) -> int:
    total = PROMPT_FRAMING_TOKENS
    for m in messages:
        total += MESSAGE_FRAMING_TOKENS + -(-len(m.content.encode()) // ESTIMATE_BYTES_PER_TOKEN)
    return total


def input_token_counter(catalog: Catalog) -> Counter:
    """Counts with the catalog model's tokenizer; the estimate for an alias the catalog lacks."""

    def count(model_alias: str, messages: Sequence[ChatMessage]) -> int:
        try:
            model = catalog.get(model_alias)
        except UnknownModel:
            return estimate_input_tokens(model_alias, messages)
        return count_input_tokens(model, [(m.role, m.content) for m in messages])

    return count
