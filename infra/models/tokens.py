"""Input-token counting with a catalog model's tokenizer, shared by the edge (its input bound and
the command's ``input_tokens``) and the workers, so neither imports the other.

``count_input_tokens(model, [(role, content), ...])`` counts the model's trusted system instructions
plus every client message; it is exactly ``count_system_tokens(model)`` plus
``count_message_tokens(model, role, content)`` of each message, which ``edge.context`` adds one
message at a time when it fits a conversation's history into the model's context. For a ``gguf``
tokenizer with llama-cpp-python installed and the pinned weights present on this host, it is the
model's real vocabulary (loaded vocabulary-only: milliseconds) plus the framing its own chat
template puts around each message (measured once per weights file: ``_framing``), which makes it the
token count of the prompt the CPU engine renders; otherwise the documented estimate:
UTF-8 bytes / ``FALLBACK_BYTES_PER_TOKEN`` rounded up, plus ``FALLBACK_TOKENS_PER_MESSAGE`` per message. English BPE
averages about 4 bytes per token, so the estimate over-counts: a limit on it is never looser than on
the real count.
"""

from __future__ import annotations

import atexit
import functools
from dataclasses import dataclass
import importlib.util
import math
from collections.abc import Iterable, Sequence

from infra.models.catalog import CatalogModel, ModelFileMissing, TokenizerKind, weights_digest
from infra.models.prompt_framing import FramingError, Render, framed_pieces, framed_prompt_ids

FALLBACK_BYTES_PER_TOKEN = 3
FALLBACK_TOKENS_PER_MESSAGE = 4
VOCABS_CACHED_MAX = 8  # distinct weights files whose vocabulary stays loaded


def fallback_token_estimate(texts: Iterable[str]) -> int:
    total = 0
    for text in texts:
        total += math.ceil(len(text.encode()) / FALLBACK_BYTES_PER_TOKEN) + FALLBACK_TOKENS_PER_MESSAGE
    return total


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@functools.lru_cache(maxsize=VOCABS_CACHED_MAX)
def vocabulary_path(model: CatalogModel) -> str | None:
    """The weights file whose vocabulary counts this model's tokens here, or None (use the estimate).

    Only the pinned weights count: a file with another digest would give another count than the
    worker's, so it is not used (the worker refuses to serve it too). Found once per model: it is on
    the edge's request path (a package lookup, a stat and a digest check per call otherwise).
    """
    if model.tokenizer is not TokenizerKind.GGUF or not llama_cpp_available():
        return None
    try:
        path = model.weights_path()
    except ModelFileMissing:
        return None
    return str(path) if weights_digest(path) == model.weights_sha256 else None


def count_input_tokens(model: CatalogModel, messages: Iterable[tuple[str, str]]) -> int:
    """Input tokens of a request: the model's trusted instructions plus the client's messages.

    Defined as ``count_system_tokens`` plus ``count_message_tokens`` of every message, so a caller
    that adds messages one at a time (``edge.context``) reaches exactly this figure.
    """
    return count_system_tokens(model) + sum(count_message_tokens(model, role, content) for role, content in messages)


def count_system_tokens(model: CatalogModel) -> int:
    """Tokens of the model's trusted system instructions framed as the system turn, plus the
    generation prompt the engine appends (``<|im_start|>assistant\n`` in ChatML): everything of a
    prompt that is not a client message.

    The estimate counts the instructions as one more message (bytes / 3 plus the framing), as it
    always has, even when they are empty: the framing of the system turn is still sent.
    """
    path = vocabulary_path(model)
    if path is not None:
        framing = _framing(path)
        return _token_count(path, model.system_instructions) + framing.system + framing.generation_prompt
    return fallback_token_estimate([model.system_instructions])


def count_message_tokens(model: CatalogModel, role: str, content: str) -> int:
    """Tokens of one client or history message, its role's framing included.

    With the model's vocabulary: the content's tokens plus the tokens the model's own chat template
    (the GGUF's ``tokenizer.chat_template``, the one the CPU engine renders) puts around a message of
    this role (``<|im_start|>user\n`` ... ``<|im_end|>\n`` in ChatML: 5 for a user message, 6 for an
    assistant one in SmolLM2's vocabulary). The content is counted as plain text, as every engine
    tokenizes it (``infra.models.prompt_framing``): a ``<|im_end|>`` typed by a user is several
    ordinary tokens, never a control token. Special tokens are atomic, so a prompt's tokens are the sum
    of its messages' (``tests/unit/test_context_tokenizer.py`` checks the sum against the ids the cpu
    engine runs). Without it: the estimate (bytes / 3 plus
    ``FALLBACK_TOKENS_PER_MESSAGE``), the same for every role.
    """
    path = vocabulary_path(model)
    if path is not None:
        framing = _framing(path)
        return _token_count(path, content) + framing.by_role.get(role, framing.by_role["user"])
    return fallback_token_estimate([content])


@dataclass(frozen=True, slots=True)
class Framing:
    """What a model's chat template adds around messages, in tokens."""

    system: int  # around the system turn (and anything the template puts before the first message)
    by_role: dict[str, int]  # around a user / assistant message
    generation_prompt: int  # after the last message, where the answer starts


@functools.lru_cache(maxsize=VOCABS_CACHED_MAX)
def _framing(path: str) -> Framing:  # pragma: no cover - needs llama-cpp-python
    """The template's framing, measured once per weights file as the engines frame a prompt.

    Framing is what ``framed_pieces`` calls template text: everything but message contents, tokenized
    with special tokens parsed; contents are tokenized as plain text (``_token_count``), so the count
    is the length of ``llama_prompt_ids`` for any content, control markers typed by a user included.
    Without a chat template in the file: ``FALLBACK_TOKENS_PER_MESSAGE`` everywhere (the figure used
    before the framing was measured), and no generation prompt.
    """
    vocab = _vocab(path)
    if not vocab.metadata.get("tokenizer.chat_template"):
        fallback = FALLBACK_TOKENS_PER_MESSAGE
        return Framing(fallback, {"user": fallback, "assistant": fallback}, 0)

    def framing_tokens(messages: list[tuple[str, str]], generation_prompt: bool) -> int:
        pieces = framed_pieces(llama_chat_render(vocab, generation_prompt), messages)
        return sum(len(vocab.tokenize(p.text.encode(), add_bos=False, special=True)) for p in pieces if p.trusted)

    system = [("system", "A")]
    base = framing_tokens(system, False)
    by_role = {role: framing_tokens([*system, (role, "A")], False) - base for role in ("user", "assistant")}
    return Framing(base, by_role, framing_tokens(system, True) - base)


def llama_chat_render(llm, generation_prompt: bool = True) -> Render:  # pragma: no cover - needs llama-cpp-python
    """Renders messages with the chat template in a llama.cpp model's GGUF metadata."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise FramingError("the GGUF file has no chat template")

    def special_text(token: int) -> str:
        return llm._model.token_get_text(token) if token >= 0 else ""

    formatter = Jinja2ChatFormatter(
        template=template, eos_token=special_text(llm.token_eos()), bos_token=special_text(llm.token_bos()),
        add_generation_prompt=generation_prompt,
    )
    return lambda messages: formatter(messages=messages).prompt


def llama_special_tokens(llm) -> dict[str, int]:  # pragma: no cover - needs llama-cpp-python
    """Every control or user-defined token of a llama.cpp model's vocabulary, ``text -> id``."""
    import llama_cpp

    wanted = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    return {llm._model.token_get_text(i): i for i in range(llm.n_vocab()) if llm._model.token_get_attr(i) & wanted}


def llama_prompt_ids(llm, render: Render, messages: Sequence[tuple[str, str]]) -> list[int]:  # pragma: no cover
    """The ids a llama.cpp engine runs for ``messages``: control tokens only from the template's own
    text, every content tokenized as plain text (``framed_prompt_ids``)."""
    return framed_prompt_ids(
        render,
        lambda text: llm.tokenize(text.encode(), add_bos=False, special=True),
        lambda text: llm.tokenize(text.encode(), add_bos=False, special=False),
        messages,
    )


@functools.lru_cache(maxsize=VOCABS_CACHED_MAX)
def _vocab(path: str):  # pragma: no cover - needs llama-cpp-python
    from llama_cpp import Llama

    vocab = Llama(model_path=path, vocab_only=True, verbose=False)
    # Free it before interpreter teardown (llama-cpp's finalizer fails once its module globals are gone).
    atexit.register(vocab.close)
    return vocab


def _token_count(path: str, text: str) -> int:  # pragma: no cover - needs llama-cpp-python
    """Tokens of ``text`` in one tokenizer pass.

    ``Llama.tokenize`` (0.3.x) sizes its buffer by the context length, which a vocabulary-only model
    reports as 0, so it tokenizes every text twice (once to learn the size); a BPE token covers at
    least one byte, so ``len(data) + 1`` tokens always suffice here.
    """
    vocab = _vocab(path)
    data = text.encode()
    handle = getattr(getattr(vocab, "_model", None), "vocab", None)
    if handle is None:  # another llama-cpp-python layout: the public (slower) call
        return len(vocab.tokenize(data, add_bos=False, special=False))
    import llama_cpp

    size = len(data) + 1
    buf = (llama_cpp.llama_token * size)()
    n = llama_cpp.llama_tokenize(handle, data, len(data), buf, size, False, False)
    if n < 0:
        return len(vocab.tokenize(data, add_bos=False, special=False))
    return n
