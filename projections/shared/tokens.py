"""Input-token counting with a catalog model's tokenizer, shared by the edge (its input bound and
the command's ``input_tokens``) and the workers, so neither imports the other.

``count_input_tokens(model, [(role, content), ...])`` counts the model's trusted system instructions
plus every client message; it is exactly ``count_system_tokens(model)`` plus
``count_message_tokens(model, role, content)`` of each message, which ``edge.context`` adds one
message at a time when it fits a conversation's history into the model's context. For a ``gguf``
tokenizer with llama-cpp-python installed and the pinned weights present on this host, it is the
model's real vocabulary (loaded vocabulary-only: milliseconds) plus ``FALLBACK_TOKENS_PER_MESSAGE``
template tokens per message; otherwise the documented estimate:
UTF-8 bytes / ``FALLBACK_BYTES_PER_TOKEN`` rounded up, plus the same framing per message. English BPE
averages about 4 bytes per token, so the estimate over-counts: a limit on it is never looser than on
the real count.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
from collections.abc import Iterable

from projections.shared.catalog import CatalogModel, ModelFileMissing, TokenizerKind, weights_digest

FALLBACK_BYTES_PER_TOKEN = 3
FALLBACK_TOKENS_PER_MESSAGE = 4
VOCABS_CACHED_MAX = 8  # distinct weights files whose vocabulary stays loaded
SYSTEM_COUNTS_CACHED_MAX = 64


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
    """Tokens of the model's trusted system instructions, framed like one message.

    The estimate counts the instructions as one more message (bytes / 3 plus the framing), as it
    always has, even when they are empty: the framing of the system turn is still sent.
    """
    path = vocabulary_path(model)
    if path is not None:
        return _system_tokens(path, model.system_instructions)
    return fallback_token_estimate([model.system_instructions])


def count_message_tokens(model: CatalogModel, role: str, content: str) -> int:
    """Tokens of one client or history message: its content plus ``FALLBACK_TOKENS_PER_MESSAGE``.

    The role's framing (``<|im_start|>user\n`` ... ``<|im_end|>\n`` in ChatML) is counted as the
    constant ``FALLBACK_TOKENS_PER_MESSAGE`` for every role, the figure ``count_input_tokens`` has
    always used, so ``role`` does not change the result today; it is a parameter so that a per-role
    framing can be added in one place and so callers (and their caches) key on the whole message.
    """
    del role  # framed by the constant per-message overhead (see above)
    path = vocabulary_path(model)
    if path is not None:
        return _token_count(path, content) + FALLBACK_TOKENS_PER_MESSAGE
    return fallback_token_estimate([content])


@functools.lru_cache(maxsize=VOCABS_CACHED_MAX)
def _vocab(path: str):  # pragma: no cover - needs llama-cpp-python
    from llama_cpp import Llama

    vocab = Llama(model_path=path, vocab_only=True, verbose=False)
    # Free it before interpreter teardown (llama-cpp's finalizer fails once its module globals are gone).
    atexit.register(vocab.close)
    return vocab


@functools.lru_cache(maxsize=SYSTEM_COUNTS_CACHED_MAX)
def _system_tokens(path: str, text: str) -> int:
    """The trusted instructions are the same for every request of a model: counted once."""
    return _token_count(path, text) + FALLBACK_TOKENS_PER_MESSAGE


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
