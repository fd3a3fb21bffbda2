"""Policy checks at their boundaries (seed section 3): a prompt check before admission at the
edge, an output check between decode steps in the worker. docs/policy.md says how they are used.

Where this sits::

    client --POST--> edge: ... burst buckets -> check_prompt(client messages) --refused--> 400 prompt_refused
                                                      | allowed                            (nothing appended)
                                                      v
                                               SubmitGeneration -> commands -> ... -> worker
    worker: engine chunk -> check_output(context, delta) --refused--> stop the engine; report failed
                              | allowed                               with code output_refused
                              v
                           TextDelta -> edge -> client

A check is anything with the ``PolicyCheck`` shape: synchronous and quick (it runs on the edge's and
the worker's event loops, once per request and once per engine chunk). It answers a ``PolicyVerdict``
that names the check, never the text or the term that matched: the boundary logs codes and ids only,
and the refusal's code is the boundary's (``prompt_refused`` / ``output_refused`` in the one error table).

The built-in check is ``Blocklist``: case-insensitive whole-word terms from a setting or a file, loaded
once at start, bounded in count and length. Another check can be plugged in by a dotted path
(``CHATPLANE_POLICY_CHECK=package.module:factory``, called with no argument); all configured checks run,
the first refusal wins. Nothing configured: no check at all (``load_policy_check`` returns None).
"""

from __future__ import annotations

import bisect
import importlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from infra.runtime.settings import SettingsError, env_var, setting
from schemas.messages import ChatMessage

# A term is a run of characters starting and ending with a word character (letters, digits, "_");
# inside it anything but a line break ("sim-token-5", "two words").
_WORD = re.compile(r"\w", re.UNICODE)
_WORDS = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True, slots=True)
class PolicyVerdict:
    """A check's answer: allowed, or refused by the check named ``check`` (never the matched text)."""

    refused: bool
    check: str = ""


ALLOWED = PolicyVerdict(refused=False)


@runtime_checkable
class PolicyCheck(Protocol):
    """What a prompt/output check provides (the built-in ``Blocklist`` is one)."""

    # Names the check in logs and verdicts (a fixed word, never content).
    name: str
    # How many characters of earlier output ``check_output`` needs before a delta (0: none), so the
    # worker keeps only that tail, not the whole answer.
    output_context_chars: int

    def check_prompt(self, messages: Sequence[ChatMessage]) -> PolicyVerdict:
        """The messages a client sent (the edge, before admission)."""
        ...

    def check_output(self, context: str, delta: str) -> PolicyVerdict:
        """The next engine text ``delta``, after ``context`` (the last ``output_context_chars`` of the
        text already allowed). The end of ``delta`` may be the middle of a word: a check that matches
        words treats it as a word's end (conservative: nothing refused is ever sent)."""
        ...

    # Optional: ``output_hold(text) -> int``, how many trailing characters of the allowed output may
    # begin something the next text would complete; the worker holds them back (``Blocklist`` has one).


class Blocklist:
    """Case-insensitive whole-word terms: a term matches where it is neither preceded nor followed by a
    word character. Matching is one pass over the text's words with a dictionary from each term's
    first word to its terms, so its cost does not grow with the number of terms."""

    name = "blocklist"

    def __init__(self, terms: Iterable[str], terms_max: int, term_chars_max: int) -> None:
        by_first: dict[str, set[str]] = {}
        count, longest = 0, 0
        for raw in terms:
            term = raw.strip().casefold()
            if not term or term.startswith("#"):
                continue
            if len(term) > term_chars_max:
                raise ValueError(f"a term longer than {term_chars_max} characters")
            if "\n" in term or "\r" in term or not (_WORD.match(term) and _WORD.match(term[-1])):
                raise ValueError("a term must start and end with a letter, digit or '_' and hold no line break")
            first = _WORDS.match(term)
            assert first is not None
            bucket = by_first.setdefault(first.group(0), set())
            if term not in bucket:
                bucket.add(term)
                count += 1
                longest = max(longest, len(term))
            if count > terms_max:
                raise ValueError(f"more than {terms_max} terms")
        self._by_first = {k: tuple(sorted(v, key=len)) for k, v in by_first.items()}
        # Every term in order, for ``output_hold``'s prefix lookups (one bisect per candidate start).
        self._sorted = sorted(t for v in by_first.values() for t in v)
        self.terms_count = count
        # A term reaching into a delta starts within the last ``longest - 1`` characters before it; one
        # more shows whether a word character precedes it (no false match on a cut word).
        self.output_context_chars = longest

    def __len__(self) -> int:
        return self.terms_count

    def matches(self, text: str, ends_after: int = 0) -> bool:
        """Whether a term occurs in ``text`` as a whole word ending after character ``ends_after``."""
        if not self._by_first:
            return False
        folded = text.casefold()
        for word in _WORDS.finditer(folded):
            candidates = self._by_first.get(word.group(0))
            if candidates is None:
                continue
            start = word.start()
            for term in candidates:
                end = start + len(term)
                if end > ends_after and folded.startswith(term, start) and not _WORD.match(folded, end):
                    return True
        return False

    def output_hold(self, text: str) -> int:
        """How many of the last characters of ``text`` (the output allowed so far, or at least its last
        ``output_context_chars``) may be the first part of a term the next text completes: the worker
        holds them back until it does or cannot (a hold-back window), so no part of a term split
        across engine chunks is sent before the part that completes it is refused. The earliest word
        start from which the rest of ``text`` is a proper prefix of some term; 0 when none is."""
        terms = self._sorted
        if not terms:
            return 0
        n = len(text)
        # A term is at most ``output_context_chars`` long; a window that long may start mid-word, so
        # its first character is never taken as a word's start unless it is the whole output.
        first = 0 if n < self.output_context_chars else n - self.output_context_chars + 1
        by_first = self._by_first
        for word in _WORDS.finditer(text, max(0, first - 1)):
            p = word.start()
            if p < first:
                continue  # the word began before the window (or is cut by it)
            # A whole word followed by more text can begin a term only as that term's first word.
            if word.end() < n and word.group(0).casefold() not in by_first:
                continue
            tail = text[p:].casefold()
            i = bisect.bisect_left(terms, tail)
            while i < len(terms) and terms[i].startswith(tail):
                if len(terms[i]) > len(tail):
                    return n - p
                i += 1
        return 0

    def check_prompt(self, messages: Sequence[ChatMessage]) -> PolicyVerdict:
        for m in messages:
            if self.matches(m.content):
                return PolicyVerdict(refused=True, check=self.name)
        return ALLOWED

    def check_output(self, context: str, delta: str) -> PolicyVerdict:
        # Only matches that reach into the delta are new: the context was judged before (and its
        # first characters may be a cut word).
        if self.matches(context + delta, ends_after=len(context.casefold())):
            return PolicyVerdict(refused=True, check=self.name)
        return ALLOWED


class PolicyChecks:
    """Several checks as one: each runs in order, the first refusal wins."""

    def __init__(self, checks: Sequence[PolicyCheck]) -> None:
        assert checks
        self.checks = tuple(checks)
        self.name = "+".join(c.name for c in self.checks)
        self.output_context_chars = max(c.output_context_chars for c in self.checks)

    def check_prompt(self, messages: Sequence[ChatMessage]) -> PolicyVerdict:
        for c in self.checks:
            verdict = c.check_prompt(messages)
            if verdict.refused:
                return verdict
        return ALLOWED

    def check_output(self, context: str, delta: str) -> PolicyVerdict:
        for c in self.checks:
            keep = c.output_context_chars
            verdict = c.check_output(context[max(0, len(context) - keep) :] if keep else "", delta)
            if verdict.refused:
                return verdict
        return ALLOWED

    def output_hold(self, text: str) -> int:
        return max(output_hold(c, text) for c in self.checks)


def output_hold(check: PolicyCheck, text: str) -> int:
    """``check.output_hold`` over its own context window when the check has one (the built-in does;
    it is optional for a plug-in, which then holds nothing back), bounded by that window."""
    hold = getattr(check, "output_hold", None)
    if hold is None:
        return 0
    keep = check.output_context_chars
    window = text[max(0, len(text) - keep) :] if keep else ""
    return min(int(hold(window)), len(window))


@dataclass(frozen=True)
class PolicySettings:
    """The policy checks' settings, shared by the edge (prompts) and the workers (output)."""

    # Blocklist terms inline (comma-separated) and/or from a file (one term per line, "#" comments);
    # both empty: no blocklist. Read once at start; more terms or longer ones stop the process.
    blocklist: str = setting("CHATPLANE_POLICY_BLOCKLIST", "")
    blocklist_path: str = setting("CHATPLANE_POLICY_BLOCKLIST_PATH", "")
    blocklist_terms_max: int = setting("CHATPLANE_POLICY_BLOCKLIST_TERMS_MAX", 10_000, ge=1)
    blocklist_term_chars_max: int = setting("CHATPLANE_POLICY_BLOCKLIST_TERM_CHARS_MAX", 128, ge=1, le=4096)
    # A further check, "package.module:factory" (the factory is called with no argument and returns a
    # PolicyCheck); empty: none.
    check: str = setting("CHATPLANE_POLICY_CHECK", "")
    # Which boundaries run the checks.
    prompts: bool = setting("CHATPLANE_POLICY_CHECK_PROMPTS", True)
    output: bool = setting("CHATPLANE_POLICY_CHECK_OUTPUT", True)


def _blocklist_terms(settings: PolicySettings) -> list[str]:
    terms = [t for t in settings.blocklist.split(",")]
    if settings.blocklist_path:
        # Bounded read: a file longer than the largest allowed list is refused, never read whole.
        bytes_max = settings.blocklist_terms_max * (settings.blocklist_term_chars_max * 4 + 64)
        var = env_var(PolicySettings, "blocklist_path")
        try:
            with open(Path(settings.blocklist_path), "rb") as f:
                data = f.read(bytes_max + 1)
        except OSError as exc:
            raise SettingsError(f"{var}={settings.blocklist_path!r}: cannot read it ({type(exc).__name__})") from None
        if len(data) > bytes_max:
            raise SettingsError(f"{var}={settings.blocklist_path!r}: longer than {bytes_max} bytes")
        try:
            terms += data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise SettingsError(f"{var}={settings.blocklist_path!r}: not UTF-8") from None
    return terms


def load_policy_check(settings: PolicySettings | None = None) -> PolicyCheck | None:
    """The configured checks as one ``PolicyCheck``, or None when none is configured.

    Raises ``SettingsError`` (one line naming the variable, never a term) on a bad list or plug-in.
    """
    settings = settings or PolicySettings()
    checks: list[PolicyCheck] = []
    try:
        blocklist = Blocklist(_blocklist_terms(settings), settings.blocklist_terms_max, settings.blocklist_term_chars_max)
    except ValueError as exc:
        raise SettingsError(f"{env_var(PolicySettings, 'blocklist')} / {env_var(PolicySettings, 'blocklist_path')}: {exc}") from None
    if len(blocklist):
        checks.append(blocklist)
    if settings.check:
        checks.append(_plug_in(settings.check))
    if not checks:
        return None
    return checks[0] if len(checks) == 1 else PolicyChecks(checks)


def _plug_in(path: str) -> PolicyCheck:
    var = env_var(PolicySettings, "check")
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise SettingsError(f"{var}={path!r}: expected package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"{var}={path!r}: cannot load it ({type(exc).__name__})") from None
    check = factory()
    if not isinstance(check, PolicyCheck):
        raise SettingsError(f"{var}={path!r}: the factory did not return a PolicyCheck")
    return check
