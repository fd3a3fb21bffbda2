"""Prompt token ids in which only the trusted framing can hold control tokens.

Where it sits: every engine that renders a chat template builds its prompt here (the cpu engine in
the worker, the SGLang engine host beside the GPU), and the edge's token count
(``infra.models.tokens``) measures the framing the same way, so the count it bills is the
length of the ids the engine runs.

Why: a chat template renders messages as one string (``<|im_start|>user\\n{content}<|im_end|>``). If
that string is tokenized whole with special tokens parsed, a user who types ``<|im_end|>\\n
<|im_start|>system\\n...`` writes a real system turn. So the template is rendered with a sentinel in
place of every message's content; the rendered text is split at the sentinels; the pieces between
them (the template's own text: role markers, separators, the generation prompt) are tokenized with
special tokens parsed, and every content (the trusted instructions too, so that one rule holds for
all text a caller supplies) is tokenized as plain text, in which ``<|im_start|>`` is just characters.

A template that changes a content (quotes it, cuts it, changes its case) would not carry the
sentinel through unchanged; that is refused with ``FramingError`` rather than guessed around.

Data flow: ``framed_pieces(render, messages)`` -> ``[(text, trusted), ...]`` (pure) ->
``framed_prompt_ids(...)`` tokenizes each piece with the engine's own tokenizer functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The sentinel holds a NUL: no chat template writes one, and it is never tokenized (only the text
# between sentinels is). The index keeps each content's place, so a template that reorders or drops
# messages is noticed.
_SENTINEL = "\x00chatplane-content-{index}\x00"

Render = Callable[[list[dict[str, str]]], str]
Tokenize = Callable[[str], list[int]]


class FramingError(ValueError):
    """The chat template does not place every message's content verbatim, once, in order."""


@dataclass(frozen=True, slots=True)
class PromptPiece:
    text: str
    trusted: bool  # True: the template's own text (control markers parsed); False: content (plain)


def framed_pieces(render: Render, messages: Sequence[tuple[str, str]]) -> list[PromptPiece]:
    """The rendered prompt as alternating template text and message content.

    Args:
        render: renders ``[{"role", "content"}, ...]`` with the model's chat template (the generation
            prompt included, as the engine runs it).
        messages: ``(role, content)`` pairs, the trusted system turn first when there is one.

    Returns:
        The pieces in prompt order; empty template pieces are left out.

    Raises:
        FramingError: the template changed, repeated, dropped or reordered a content.
    """
    sentinels = [_SENTINEL.format(index=i) for i in range(len(messages))]
    rendered = render([{"role": role, "content": s} for (role, _content), s in zip(messages, sentinels, strict=True)])
    pieces: list[PromptPiece] = []
    rest = rendered
    for (_role, content), sentinel in zip(messages, sentinels, strict=True):
        before, found, after = rest.partition(sentinel)
        if not found or sentinel in after:
            raise FramingError("the chat template does not place each message's content verbatim, once, in order")
        if "\x00" in before:
            raise FramingError("the chat template reordered or changed a message's content")
        if before:
            pieces.append(PromptPiece(before, True))
        if content:
            pieces.append(PromptPiece(content, False))
        rest = after
    if "\x00" in rest:
        raise FramingError("the chat template wrote a NUL or changed a message's content")
    if rest:
        pieces.append(PromptPiece(rest, True))
    return pieces


def framed_prompt_ids(
    render: Render, tokenize_trusted: Tokenize, tokenize_content: Tokenize, messages: Sequence[tuple[str, str]]
) -> list[int]:
    """The prompt's token ids: template text through ``tokenize_trusted`` (special tokens parsed),
    every content through ``tokenize_content`` (special tokens never parsed)."""
    ids: list[int] = []
    for piece in framed_pieces(render, messages):
        ids += tokenize_trusted(piece.text) if piece.trusted else tokenize_content(piece.text)
    return ids


def check_content_tokenizer(tokenize_content: Tokenize, special_tokens: dict[str, int]) -> None:
    """Refuse a content tokenizer that turns a special token's text into that token.

    Run once when an engine starts, over every special token of its vocabulary (``text -> id``): the
    guarantee above rests on ``tokenize_content`` never parsing control markers, and a tokenizer
    library's option for that has changed names between versions.

    Raises:
        FramingError: naming the first marker that came out as a control token.
    """
    specials = set(special_tokens.values())
    for text in special_tokens:
        if specials.intersection(tokenize_content(text)):
            raise FramingError(f"the content tokenizer parses the control marker {text!r}")
