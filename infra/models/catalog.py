"""The model catalog: one TOML file that the processor, the edge and every worker read.

Where it sits in the data flow::

    models.toml (CHATPLANE_MODEL_CATALOG, default: the file shipped beside this module)
        |-- processor: Policy.models (alias -> pinned version, pool, tiers) -> GenerationAdmitted.model_version
        |-- edge:      the same aliases for its bounds; the tokenizer for counting input tokens
        `-- worker:    the alias it serves: engine, weights (digest verified at start), instructions

Per alias: ``version`` (the model's name), ``engine`` (``cpu``, ``sglang`` or ``sim``), ``weights`` and
``weights_sha256`` (required for engines that load weights, forbidden for the simulator), ``pool``
(default: the version's name, so one pool per model version), ``tiers``, ``system_instructions``
(the trusted instructions the worker prepends), ``context_tokens`` and ``tokenizer``. The version
stored at admission is ``<version>@sha256:<first 12 hex of the weights digest>`` for models with
weights, so a dispatch names the exact weights and only a worker holding them serves it.

An invalid file stops the process that reads it with one line naming the file and the field
(``CatalogError``); docs/models.md describes every field.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import importlib.util
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from control_plane.policy import ModelEntry
from schemas.codes import Tier

CATALOG_ENV = "CHATPLANE_MODEL_CATALOG"
DEFAULT_CATALOG_PATH = Path(__file__).with_name("models.toml")
DIGEST_HEX_CHARS = 12  # of the weights' sha256, in the pinned version
SHA256_HEX_CHARS = 64
DIGEST_READ_CHUNK_BYTES = 1 << 20
PACKAGE_WEIGHTS_PREFIX = "package:"
CONTEXT_TOKENS_MAX = 10_000_000
SYSTEM_INSTRUCTIONS_CHARS_MAX = 16_384
# Names that end up in topic names (pools) or in every ledger event (versions).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,99}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class EngineKind(StrEnum):
    """The engines a catalog entry may name (``workers.engines``)."""

    CPU = "cpu"  # llama.cpp over a GGUF file
    SGLANG = "sglang"  # SGLang on a GPU host
    SIM = "sim"  # the simulator: no model runs; only ever serves a simulator alias


ENGINES_WITH_WEIGHTS = frozenset({EngineKind.CPU, EngineKind.SGLANG})


class TokenizerKind(StrEnum):
    GGUF = "gguf"  # the weights' own vocabulary, through llama.cpp (vocabulary only)
    ESTIMATE = "estimate"  # UTF-8 bytes / 3 + per-message framing: never under-counts BPE text


class CatalogError(ValueError):
    """An invalid catalog; ``str()`` is one line naming the file and the field."""


class UnknownModel(LookupError):
    """An alias that is not in the catalog."""


class ModelNotAllowed(PermissionError):
    """The alias exists but the tier may not use it (``model_not_allowed``)."""


class ModelFileMissing(FileNotFoundError):
    """The weights of a model are not installed on this host."""


class WeightsMismatch(RuntimeError):
    """The local weights are not the ones the catalog pins."""


_MODEL_KEYS = {
    "version", "engine", "weights", "weights_sha256", "pool", "tiers", "system_instructions",
    "context_tokens", "tokenizer", "created",
}


@dataclass(frozen=True, slots=True)
class CatalogModel:
    """One alias of the catalog, as every process sees it."""

    alias: str
    version_name: str
    engine: EngineKind
    pool: str
    tiers: frozenset[Tier]
    system_instructions: str
    context_tokens: int
    tokenizer: TokenizerKind
    weights: str | None = None  # "package:<pkg>/<file>" or a path (relative to the catalog file)
    weights_sha256: str | None = None
    catalog_dir: Path | None = None
    # When this alias's pinned version was published (Unix seconds): /v1/models' "created". None: not given.
    created_s: int | None = None

    @property
    def version(self) -> str:
        """The pinned version stored at admission and carried by every dispatch."""
        if self.weights_sha256:
            return f"{self.version_name}@sha256:{self.weights_sha256[:DIGEST_HEX_CHARS]}"
        return self.version_name

    def entry(self) -> ModelEntry:
        """The core's view (``Policy.models``): version, pool and tiers only."""
        return ModelEntry(self.alias, self.version, self.pool, self.tiers)

    def check_tier(self, tier: Tier) -> None:
        if tier not in self.tiers:
            raise ModelNotAllowed(f"{self.alias} is not available to the {tier.value} tier")

    def serves(self, model_version: str) -> bool:
        """Whether a dispatch for ``model_version`` may run on this model: the exact pinned version."""
        return model_version == self.version

    def weights_path(self) -> Path:
        """Where the weights are on this host (not verified: see ``verify_weights``)."""
        if self.weights is None:
            raise ModelFileMissing(f"{self.alias} has no weights (engine {self.engine.value})")
        if self.weights.startswith(PACKAGE_WEIGHTS_PREFIX):
            package, _, rel = self.weights[len(PACKAGE_WEIGHTS_PREFIX):].partition("/")
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise ModelFileMissing(f"weights of {self.alias}: package {package} is not installed")
            path = Path(next(iter(spec.submodule_search_locations))) / rel
        else:
            path = Path(self.weights)
            if not path.is_absolute() and self.catalog_dir is not None:
                path = self.catalog_dir / path
        if not path.exists():
            raise ModelFileMissing(f"weights of {self.alias}: {path} is missing")
        return path

    def verify_weights(self) -> Path:
        """The weights' path once their sha256 equals the pinned digest; raises otherwise."""
        path = self.weights_path()
        digest = weights_digest(path)
        if digest != self.weights_sha256:
            raise WeightsMismatch(
                f"weights of {self.alias} at {path} have sha256 {digest[:DIGEST_HEX_CHARS]}..., the catalog pins "
                f"{(self.weights_sha256 or '')[:DIGEST_HEX_CHARS]}... ({self.version}): refusing to serve another version"
            )
        return path


@dataclass(frozen=True, slots=True)
class Catalog:
    source: str
    models: Mapping[str, CatalogModel]

    def get(self, alias: str) -> CatalogModel:
        try:
            return self.models[alias]
        except KeyError:
            raise UnknownModel(alias) from None

    def resolve(self, alias: str, tier: Tier) -> CatalogModel:
        """The model an alias names for a tier, or ``UnknownModel`` / ``ModelNotAllowed``."""
        model = self.get(alias)
        model.check_tier(tier)
        return model

    def policy_models(self) -> dict[str, ModelEntry]:
        """The processor's ``Policy.models``."""
        return {alias: m.entry() for alias, m in self.models.items()}

    def pools(self) -> tuple[str, ...]:
        """Every pool the catalog names (one dispatch topic per pool and tier)."""
        return tuple(sorted({m.pool for m in self.models.values()}))


# --- parsing and validation -------------------------------------------------------------------------


def _fail(source: str, where: str, problem: str) -> CatalogError:
    return CatalogError(f"model catalog {source}: {where}: {problem}")


def _str_field(source: str, alias: str, raw: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
    value = raw.get(key, default)
    if value is not None and not isinstance(value, str):
        raise _fail(source, f"models.{alias}.{key}", f"expected a string, got {type(value).__name__}")
    return value


def _model(source: str, alias: str, raw: Any, catalog_dir: Path | None) -> CatalogModel:
    where = f"models.{alias}"
    if not isinstance(raw, dict):
        raise _fail(source, where, "expected a table")
    if not _ALIAS.fullmatch(alias):
        raise _fail(source, where, "an alias is 1-100 of A-Z a-z 0-9 . _ : - starting with a letter or digit")
    unknown = sorted(set(raw) - _MODEL_KEYS)
    if unknown:
        raise _fail(source, f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(_MODEL_KEYS))})")
    version = _str_field(source, alias, raw, "version")
    if version is None:
        raise _fail(source, f"{where}.version", "missing")
    if not _NAME.fullmatch(version):
        raise _fail(source, f"{where}.version", f"{version!r} is not 1-100 of A-Z a-z 0-9 . _ - (the digest is added from weights_sha256)")
    engine_raw = _str_field(source, alias, raw, "engine")
    if engine_raw is None:
        raise _fail(source, f"{where}.engine", "missing")
    try:
        engine = EngineKind(engine_raw)
    except ValueError:
        raise _fail(source, f"{where}.engine", f"unknown engine {engine_raw!r} (one of {', '.join(e.value for e in EngineKind)})") from None
    weights = _str_field(source, alias, raw, "weights")
    sha = _str_field(source, alias, raw, "weights_sha256")
    if engine in ENGINES_WITH_WEIGHTS:
        if not weights:
            raise _fail(source, f"{where}.weights", f"the {engine.value} engine needs weights (a path or package:<pkg>/<file>)")
        if not sha or not _SHA256.fullmatch(sha):
            raise _fail(source, f"{where}.weights_sha256", f"the {engine.value} engine needs the weights' sha256 (64 lowercase hex)")
    elif weights is not None or sha is not None:
        raise _fail(source, f"{where}.{'weights' if weights is not None else 'weights_sha256'}", "the simulator runs no weights")
    pool = _str_field(source, alias, raw, "pool", version)
    assert pool is not None
    if not _NAME.fullmatch(pool):
        raise _fail(source, f"{where}.pool", f"{pool!r} is not 1-100 of A-Z a-z 0-9 . _ - (it names Kafka topics)")
    tiers_raw = raw.get("tiers", [t.value for t in Tier])
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise _fail(source, f"{where}.tiers", "expected a non-empty list of tiers")
    try:
        tiers = frozenset(Tier(t) for t in tiers_raw)
    except ValueError:
        raise _fail(source, f"{where}.tiers", f"{tiers_raw!r}: tiers are {', '.join(t.value for t in Tier)}") from None
    instructions = _str_field(source, alias, raw, "system_instructions", "")
    assert instructions is not None
    if len(instructions) > SYSTEM_INSTRUCTIONS_CHARS_MAX:
        raise _fail(source, f"{where}.system_instructions", f"longer than {SYSTEM_INSTRUCTIONS_CHARS_MAX} characters")
    context = raw.get("context_tokens")
    if context is None:
        raise _fail(source, f"{where}.context_tokens", "missing")
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= CONTEXT_TOKENS_MAX:
        raise _fail(source, f"{where}.context_tokens", f"expected an integer from 1 to {CONTEXT_TOKENS_MAX}")
    default_tokenizer = TokenizerKind.GGUF if engine is EngineKind.CPU else TokenizerKind.ESTIMATE
    tokenizer_raw = _str_field(source, alias, raw, "tokenizer", default_tokenizer.value)
    try:
        tokenizer = TokenizerKind(tokenizer_raw)
    except ValueError:
        raise _fail(source, f"{where}.tokenizer", f"{tokenizer_raw!r}: one of {', '.join(t.value for t in TokenizerKind)}") from None
    if tokenizer is TokenizerKind.GGUF and engine is not EngineKind.CPU:
        raise _fail(source, f"{where}.tokenizer", "gguf counts with a cpu model's own weights; use estimate")
    created = raw.get("created")
    if created is not None and not (isinstance(created, dt.datetime) and created.utcoffset() is not None):
        raise _fail(source, f"{where}.created", "expected a TOML date-time with its offset, e.g. 2024-11-01T00:00:00Z")
    return CatalogModel(
        alias=alias, version_name=version, engine=engine, pool=pool, tiers=tiers, system_instructions=instructions,
        context_tokens=context, tokenizer=tokenizer, weights=weights, weights_sha256=sha, catalog_dir=catalog_dir,
        created_s=int(created.timestamp()) if created is not None else None,
    )


def parse_catalog(text: str, source: str = "<text>", catalog_dir: Path | None = None) -> Catalog:
    """A validated catalog from TOML text; ``CatalogError`` (one line) when it is not valid."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # a duplicate alias is one of these
        raise CatalogError(f"model catalog {source}: {' '.join(str(exc).split())}") from None
    unknown = sorted(set(doc) - {"models"})
    if unknown:
        raise _fail(source, unknown[0], "unknown top-level field (the file holds [models.<alias>] tables)")
    raw_models = doc.get("models")
    if not isinstance(raw_models, dict) or not raw_models:
        raise _fail(source, "models", "no [models.<alias>] table")
    models = {alias: _model(source, alias, raw, catalog_dir) for alias, raw in raw_models.items()}
    # Two versions in one pool would share one consumer group and decline each other's dispatches.
    by_pool: dict[str, str] = {}
    for m in models.values():
        other = by_pool.setdefault(m.pool, m.version)
        if other != m.version:
            raise _fail(source, f"models.{m.alias}.pool", f"pool {m.pool!r} already serves {other}; one pool serves one version")
    return Catalog(source, models)


def catalog_path() -> Path:
    """The catalog file this process reads: ``CHATPLANE_MODEL_CATALOG`` or the shipped default."""
    raw = os.environ.get(CATALOG_ENV, "")
    return Path(raw) if raw else DEFAULT_CATALOG_PATH


@functools.cache
def _load(path: str) -> Catalog:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"model catalog {path}: cannot read it ({exc.strerror or exc}); set {CATALOG_ENV}") from None
    return parse_catalog(text, path, p.resolve().parent)


def load_catalog(path: Path | str | None = None) -> Catalog:
    """The catalog at ``path`` (default: ``catalog_path()``), parsed once per path."""
    return _load(str(path if path is not None else catalog_path()))


# --- weights digests --------------------------------------------------------------------------------


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(DIGEST_READ_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(path: Path) -> str:
    """sha256 of a weights file (cached per path, size and mtime).

    A directory (an SGLang model folder) digests as the sha256 of its files' relative paths and
    digests, in path order, so a changed, added or removed file changes it.
    """
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}\0{weights_digest(f)}\n".encode())
        return h.hexdigest()
    st = path.stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns)
