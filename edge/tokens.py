"""Input-token counting for the edge's bound, behind one small interface: ``counter(alias, messages)``.

The model registry (``workers/registry.py``) carries each model's tokenizer:
``count_input_tokens(alias, [(role, content), ...])`` counts with the model's real vocabulary when
llama-cpp-python and the weights are installed, and with the registry's documented estimate
otherwise; it also counts the model's trusted system instructions, which the worker installs. The
edge uses it for every alias the registry knows. For an alias the registry does not know (a catalog
configured only in the processor's policy) the edge uses its own conservative estimate: UTF-8 bytes
/ 3 rounded up per message plus a per-message framing overhead (ChatML adds about 4 tokens per
message). BPE tokenizers for English average about 4 bytes per token, so the estimate over-counts
ordinary text, which errs on the side of the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def input_token_counter() -> Counter:
    """The registry's counter when ``workers.registry`` is importable, else the estimate."""
    try:
        from workers import registry
    except Exception:  # noqa: BLE001 - the registry is optional for the edge; fall back to the estimate
        return estimate_input_tokens

    def count(model_alias: str, messages: Sequence[ChatMessage]) -> int:
        try:
            return registry.count_input_tokens(model_alias, [(m.role, m.content) for m in messages])
        except registry.UnknownModel:
            return estimate_input_tokens(model_alias, messages)

    return count
