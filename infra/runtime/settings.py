"""The one settings loader every process uses, and the admission policy the processor and the edge share.

Every process (the edge, the processor, the workers, the read-model writer, the ``infra/`` scripts)
reads its ``CHATPLANE_*`` environment variables once, at start-up, through this module. A settings
class is a frozen dataclass whose fields are made by ``setting``::

    @dataclass(frozen=True)
    class EdgeSettings:
        port: int = setting("CHATPLANE_EDGE_PORT", 8080, ge=1, le=65_535)

so ``EdgeSettings()`` reads the environment, ``EdgeSettings(port=9000)`` overrides a field from code
(tests) and ``dataclasses.replace`` works as on any dataclass. A value needed outside a class is read
with ``env_value`` (same rules).

Rules, the same for every variable:

- Unset or empty: the default.
- ``int``: a decimal integer (``10_000`` is allowed, as in Python); ``float``: a finite decimal number;
  ``bool``: exactly ``1`` or ``true`` for on, ``0`` or ``false`` for off (anything else is an error,
  never silently off); ``str``: as written; lists: comma-separated, blank items ignored.
- A value that does not parse, breaks its bound (``ge``/``gt``/``le``) or is not one of its
  ``choices`` raises ``SettingsError``, whose message is one line naming the variable, the value and
  what was expected: ``CHATPLANE_EDGE_PORT='abc': expected an integer``. Each entry point catches it,
  prints that line to stderr and exits with status 2.
- Bounds apply to what the environment says; values passed from code are taken as given.

This module imports only the standard library, ``schemas`` and ``control_plane`` (no I/O client), so
``infra/stack.py`` can use it from the source tree before anything else is importable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from control_plane.policy import Policy, RiskLimits
from infra.models.catalog import CATALOG_ENV, CatalogError, load_catalog
from schemas.codes import Tier

T = TypeVar("T")

SETTINGS_ERROR_EXIT_STATUS = 2  # as argparse's usage errors: the process was started wrongly


class SettingsError(ValueError):
    """A ``CHATPLANE_*`` variable that does not parse or is out of range; ``str(error)`` is one line."""


def _parse_int(raw: str) -> int:
    return int(raw)


def _parse_float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def _parse_bool(raw: str) -> bool:
    if raw in ("1", "true"):
        return True
    if raw in ("0", "false"):
        return False
    raise ValueError(raw)


def _parse_str(raw: str) -> str:
    return raw


def comma_list(raw: str) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``; a list with no item is refused."""
    items = tuple(item.strip() for item in raw.split(",") if item.strip())
    if not items:
        raise ValueError(raw)
    return items


# The parser and the words of the error message for each plain type, chosen by the default's type.
_PARSERS: dict[type, tuple[Callable[[str], Any], str]] = {
    bool: (_parse_bool, '"1", "true", "0" or "false"'),
    int: (_parse_int, "an integer"),
    float: (_parse_float, "a number"),
    str: (_parse_str, "a string"),
}


def _bounds_text(ge: float | None, gt: float | None, le: float | None) -> str:
    parts = [f">= {ge}" if ge is not None else "", f"> {gt}" if gt is not None else "", f"<= {le}" if le is not None else ""]
    return " and ".join(p for p in parts if p)


def env_value(
    var: str,
    default: T,
    *,
    kind: type | None = None,
    parse: Callable[[str], Any] | None = None,
    expected: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: Sequence[str] | None = None,
    default_factory: Callable[[], T] | None = None,
) -> T:
    """The value of ``var`` now, parsed and checked; the default when it is unset or empty.

    Args:
        var: the variable's name, ``CHATPLANE_*``.
        default: the value when unset (not checked: it is ours); ignored when ``default_factory`` is given.
        kind: ``int``, ``float``, ``bool`` or ``str``; by default the default's type.
        parse: instead of ``kind``, a function from the text to the value that raises ``ValueError``.
        expected: what ``parse`` accepts, for the error message.
        ge, gt, le: bounds on a number.
        choices: the accepted texts of a ``str``.
        default_factory: computes the default when the variable is unset (a host name, a random id).
    """
    raw = os.environ.get(var, "")
    if raw == "":
        return default_factory() if default_factory is not None else default
    if parse is None:
        parse, words = _PARSERS[kind or type(default)]
        expected = expected or words
    expected = expected or "a valid value"
    try:
        value = parse(raw)
    except (ValueError, TypeError):
        raise SettingsError(f"{var}={raw!r}: expected {expected}") from None
    if choices is not None and value not in choices:
        raise SettingsError(f"{var}={raw!r}: expected one of {', '.join(choices)}")
    if (ge is not None and value < ge) or (gt is not None and value <= gt) or (le is not None and value > le):
        raise SettingsError(f"{var}={raw!r}: expected {expected} {_bounds_text(ge, gt, le)}")
    return value  # type: ignore[no-any-return]


def setting(var: str, default: Any = None, **checks: Any) -> Any:
    """A dataclass field read from ``var`` when the class is built without it.

    ``checks`` are ``env_value``'s keywords (``kind``, ``parse``, ``expected``, ``ge``, ``gt``, ``le``,
    ``choices``, ``default_factory``), applied when the class is built.
    """

    def read() -> Any:
        return env_value(var, default, **checks)

    return dataclasses.field(default_factory=read, metadata={"env": var})


# The one development switch (strict bool, default off; `make up` and the tests set it to 1). It only
# allows development conveniences, such as the edge's built-in secrets standing in for unset ones;
# without it every process requires its real secrets and refuses to start without them.
DEV_MODE_ENV = "CHATPLANE_DEV_MODE"

# Where every process finds Kafka unless told otherwise: the broker ``make up`` starts on this machine.
KAFKA_BOOTSTRAP_ENV = "CHATPLANE_KAFKA_BOOTSTRAP"
KAFKA_BOOTSTRAP_DEFAULT = "127.0.0.1:9092"


def kafka_bootstrap_setting() -> Any:
    """The ``kafka_bootstrap`` field of a settings class (``CHATPLANE_KAFKA_BOOTSTRAP``)."""
    return setting(KAFKA_BOOTSTRAP_ENV, KAFKA_BOOTSTRAP_DEFAULT)


def kafka_bootstrap() -> str:
    """The bootstrap servers a command line defaults to (``CHATPLANE_KAFKA_BOOTSTRAP``)."""
    return env_value(KAFKA_BOOTSTRAP_ENV, KAFKA_BOOTSTRAP_DEFAULT)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(default: str) -> str:
    """``CHATPLANE_LOG_LEVEL`` (any case), one of ``LOG_LEVELS``; each process has its own default."""
    return str(env_value("CHATPLANE_LOG_LEVEL", default, parse=str.upper, expected="a log level", choices=LOG_LEVELS))


def env_var(cls: type, field_name: str) -> str:
    """The variable a settings field is read from (for messages about a relation between fields)."""
    return str(next(f for f in dataclasses.fields(cls) if f.name == field_name).metadata["env"])


def exit_on_settings_error(error: SettingsError) -> NoReturn:
    """An entry point's answer to a bad setting: the one line on stderr, status 2, no traceback."""
    print(error, file=sys.stderr, flush=True)
    raise SystemExit(SETTINGS_ERROR_EXIT_STATUS)


def policy_from_env() -> Policy:
    """The admission policy; every limit can be set by a ``CHATPLANE_*`` variable.

    The one place the processor and the edge build their ``Policy`` from the environment. Its models
    are the catalog file's (``CHATPLANE_MODEL_CATALOG``, default: the shipped ``models.toml``), the
    same file every worker reads; an invalid file is a ``SettingsError`` naming the variable.
    """
    try:
        models = load_catalog().policy_models()
    except CatalogError as exc:
        raise SettingsError(f"{CATALOG_ENV}: {exc}") from None
    base = Policy()
    return Policy(
        models=models,
        quota_limit_by_tier={
            Tier.FREE: env_value("CHATPLANE_QUOTA_FREE_PER_WINDOW", base.quota_limit_by_tier[Tier.FREE], ge=0),
            Tier.PAID: env_value("CHATPLANE_QUOTA_PAID_PER_WINDOW", base.quota_limit_by_tier[Tier.PAID], ge=0),
        },
        concurrency_limit=env_value("CHATPLANE_CONCURRENCY_LIMIT", base.concurrency_limit, ge=1),
        queue_wait_max_ms=env_value("CHATPLANE_QUEUE_WAIT_MAX_MS", base.queue_wait_max_ms, ge=1),
        queue_budget_ms=env_value("CHATPLANE_QUEUE_BUDGET_MS", base.queue_budget_ms, ge=0),
        reconcile_grace_ms=env_value("CHATPLANE_RECONCILE_GRACE_MS", base.reconcile_grace_ms, ge=0),
        lease_ms=env_value("CHATPLANE_LEASE_MS", base.lease_ms, ge=1),
        generation_duration_max_ms=env_value("CHATPLANE_GENERATION_DURATION_MAX_MS", base.generation_duration_max_ms, ge=1),
        dedup_retention_ms=env_value("CHATPLANE_DEDUP_RETENTION_MS", base.dedup_retention_ms, ge=0),
        dedup_records_per_user_max=env_value(
            "CHATPLANE_DEDUP_RECORDS_PER_USER_MAX", base.dedup_records_per_user_max, ge=1
        ),
        result_ttl_ms=env_value("CHATPLANE_RESULT_TTL_MS", base.result_ttl_ms, ge=1),
        # Seconds, as the client's timeouts are; 0 turns the matching off (docs/edge.md).
        openai_retry_attach_ms=1000 * env_value(
            "CHATPLANE_OPENAI_RETRY_ATTACH_S", base.openai_retry_attach_ms // 1000, ge=0, le=OPENAI_RETRY_ATTACH_S_MAX
        ),
        max_output_tokens_max=env_value("CHATPLANE_MAX_OUTPUT_TOKENS_MAX", base.max_output_tokens_max, ge=1),
        # Token budgets per tier and window (0 = off, the default: docs/core.md, "Token budget").
        token_budget_by_tier={
            Tier.FREE: env_value("CHATPLANE_TOKEN_BUDGET_FREE", base.token_budget(Tier.FREE), ge=0),
            Tier.PAID: env_value("CHATPLANE_TOKEN_BUDGET_PAID", base.token_budget(Tier.PAID), ge=0),
        },
        token_overshoot_max=env_value("CHATPLANE_TOKEN_OVERSHOOT_MAX", base.token_overshoot_max, ge=0),
        token_lost_report_bound=env_value("CHATPLANE_TOKEN_LOST_REPORT_BOUND", base.token_lost_report_bound, ge=0),
        risk_classes=env_value(
            "CHATPLANE_RISK_CLASSES",
            base.risk_classes,
            parse=_parse_risk_classes,
            expected="name=quota/tokens/concurrency[,...] (each a number or '-')",
        ),
        risk_class_by_user=env_value(
            "CHATPLANE_ACCOUNT_RISK_CLASSES",
            base.risk_class_by_user,
            parse=_parse_account_risk_classes,
            expected=f"user_id=class[,...] (at most {ACCOUNT_RISK_CLASSES_MAX})",
        ),
    )


# The attach window of keyless retries is at most an hour: the result of a completed generation is
# kept for ``CHATPLANE_RESULT_TTL_MS`` (1 h by default), and a retry comes seconds after its first try.
OPENAI_RETRY_ATTACH_S_MAX = 3600
# The per-account risk setting names at most this many accounts (a per-key map, bounded).
ACCOUNT_RISK_CLASSES_MAX = 10_000
_RISK_NAME = re.compile(r"^[a-z0-9_]{1,32}$")


def _parse_risk_classes(raw: str) -> dict[str, Any]:
    """``elevated=10/20000/1,watch=-/50000/-``: per class, quota / token budget / concurrency."""
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        name, _, limits = item.partition("=")
        parts = limits.split("/")
        if not _RISK_NAME.match(name) or len(parts) != 3:
            raise ValueError(item)
        values = [None if p.strip() == "-" else int(p) for p in parts]
        if any(v is not None and v < 0 for v in values):
            raise ValueError(item)
        if values[2] is not None and values[2] < 1:
            raise ValueError(item)
        out[name] = RiskLimits(quota_limit=values[0], token_budget=values[1], concurrency_limit=values[2])
    return out


def _parse_account_risk_classes(raw: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        user, _, name = item.partition("=")
        if not user or not _RISK_NAME.match(name):
            raise ValueError(item)
        out[user] = name
    if len(out) > ACCOUNT_RISK_CLASSES_MAX:
        raise ValueError(raw)
    return out
