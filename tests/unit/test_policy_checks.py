"""Policy checks (infra/content/policy_checks.py): the blocklist, the interface, loading, and the
worker's reports of an output refusal."""

from __future__ import annotations

import pytest

from infra.content.policy_checks import (
    ALLOWED,
    Blocklist,
    PolicyCheck,
    PolicyChecks,
    PolicySettings,
    PolicyVerdict,
    load_policy_check,
    output_hold,
)
from infra.runtime.settings import SettingsError
from schemas.codes import REJECTIONS, FinishOutcome, FinishReason, RejectionCode
from schemas.messages import ChatMessage
from workers.attempt import StopReason, keeps_result, stop_report


def blocklist(*terms: str) -> Blocklist:
    return Blocklist(terms, terms_max=100, term_chars_max=32)


def test_whole_words_case_insensitive():
    b = blocklist("Forbidden", "sim-token-5", "two words")
    assert b.matches("this is FORBIDDEN.") and b.matches("forbidden") and b.matches("(forbidden)")
    assert not b.matches("unforbidden forbiddenness")
    assert b.matches("a sim-token-5 b") and not b.matches("sim-token-50") and not b.matches("xsim-token-5")
    assert b.matches("say Two Words now") and not b.matches("two wordsmiths")
    assert not blocklist().matches("anything") and len(blocklist()) == 0


def test_prompt_check_looks_at_every_message_and_names_only_the_check():
    b = blocklist("forbidden")
    allowed = (ChatMessage(role="user", content="hello"),)
    refused = (ChatMessage(role="assistant", content="Forbidden!"), ChatMessage(role="user", content="hi"))
    assert b.check_prompt(allowed) == ALLOWED
    verdict = b.check_prompt(refused)
    assert verdict == PolicyVerdict(refused=True, check="blocklist")
    assert "forbidden" not in repr(verdict).lower()


def test_output_check_sees_a_term_split_across_deltas_and_ignores_judged_context():
    b = blocklist("sim-token-5")
    assert b.output_context_chars == len("sim-token-5")
    # The term's end arrives in the delta: refused (the end of a delta counts as a word's end).
    assert b.check_output("sim-tok", "en-5").refused
    assert not b.check_output("sim-token-4", " sim-token-").refused
    # A term that lies wholly in the context was judged before; a cut word at its start is no match.
    assert not b.check_output("sim-token-5", " next").refused


def test_output_hold_covers_the_start_of_a_term_the_next_text_may_complete():
    b = blocklist("sim-token-5", "two words", "Ab")
    # The earliest word start from which the rest is a proper prefix of a term: held back.
    assert b.output_hold("say sim-tok") == len("sim-tok")
    assert b.output_hold("say sim-") == len("sim-")
    assert b.output_hold("say TWO WO") == len("TWO WO")
    assert b.output_hold("say two") == len("two")
    # No term starts there, or it starts mid-word, or the tail already is a whole term (which the
    # check refuses itself): nothing held.
    assert b.output_hold("say sim-token-4") == 0
    assert b.output_hold("say twofold") == 0
    assert b.output_hold("unsim-tok") == 0
    assert b.output_hold("say ab") == 0
    assert b.output_hold("") == 0 and blocklist().output_hold("anything") == 0
    # A window cut to output_context_chars never takes its first character for a word's start.
    window = "x" * (b.output_context_chars - 3) + "two"
    assert len(window) == b.output_context_chars and b.output_hold(window) == 0
    assert b.output_hold("a" + window[1:].replace("x", " ")) == 3


def test_several_checks_hold_the_longest_and_a_plug_in_without_a_hold_holds_nothing():
    class NoHold:
        name = "nohold"
        output_context_chars = 4

        def check_prompt(self, messages):  # pragma: no cover - not called here
            return ALLOWED

        def check_output(self, context, delta):
            return ALLOWED

    both = PolicyChecks([blocklist("two words"), blocklist("three little words"), NoHold()])
    assert output_hold(NoHold(), "three little") == 0  # type: ignore[arg-type]
    assert both.output_hold("say three little") == len("three little")
    assert both.output_hold("say two") == len("two")
    # Each check is given its own window of a shorter context whole (it was cut from its end once).
    assert both.check_output("say three lit", "tle words").refused
    assert both.check_output("x ", "two words").refused and not both.check_output("two", " wordsmith").refused


def test_bounds_and_term_shape_are_enforced():
    with pytest.raises(ValueError, match="more than 2 terms"):
        Blocklist(["a", "b", "c"], terms_max=2, term_chars_max=10)
    with pytest.raises(ValueError, match="longer than 3"):
        Blocklist(["abcd"], terms_max=2, term_chars_max=3)
    with pytest.raises(ValueError, match="start and end"):
        Blocklist(["-dash"], terms_max=2, term_chars_max=10)
    # Blank lines and comments are skipped, duplicates counted once.
    assert len(Blocklist(["", "# note", "a", "A "], terms_max=1, term_chars_max=10)) == 1


def test_loading_from_settings_file_and_plug_in(tmp_path):
    assert load_policy_check(PolicySettings(blocklist="", blocklist_path="")) is None
    path = tmp_path / "terms.txt"
    path.write_text("# one per line\nfilelisted\n")
    check = load_policy_check(PolicySettings(blocklist="inline", blocklist_path=str(path)))
    assert isinstance(check, Blocklist) and len(check) == 2
    assert check.matches("FileListed") and check.matches("inline")
    combined = load_policy_check(
        PolicySettings(blocklist="inline", check="tests.unit.test_policy_checks:refuse_all_output")
    )
    assert isinstance(combined, PolicyChecks) and isinstance(combined, PolicyCheck)
    assert combined.check_prompt((ChatMessage(role="user", content="fine"),)) == ALLOWED
    assert combined.check_output("", "anything") == PolicyVerdict(refused=True, check="refuse-output")
    with pytest.raises(SettingsError, match="CHATPLANE_POLICY_CHECK="):
        load_policy_check(PolicySettings(check="no_such_module:factory"))
    with pytest.raises(SettingsError, match="CHATPLANE_POLICY_BLOCKLIST_PATH"):
        load_policy_check(PolicySettings(blocklist_path=str(tmp_path / "missing.txt")))
    with pytest.raises(SettingsError, match="CHATPLANE_POLICY_BLOCKLIST") as err:
        load_policy_check(PolicySettings(blocklist="ok,toolongterm", blocklist_term_chars_max=5))
    assert "toolongterm" not in str(err.value)  # never a term in a message


class _RefuseOutput:
    name = "refuse-output"
    output_context_chars = 0

    def check_prompt(self, messages):
        return ALLOWED

    def check_output(self, context, delta):
        return PolicyVerdict(refused=True, check=self.name)


def refuse_all_output() -> _RefuseOutput:
    """A plug-in factory for the test above (CHATPLANE_POLICY_CHECK=module:factory)."""
    return _RefuseOutput()


def test_codes_and_the_workers_report_of_an_output_refusal():
    assert REJECTIONS[RejectionCode.PROMPT_REFUSED].http_status == 400
    assert REJECTIONS[RejectionCode.OUTPUT_REFUSED].http_status == 422
    assert not REJECTIONS[RejectionCode.OUTPUT_REFUSED].retryable
    assert stop_report(StopReason.OUTPUT_REFUSED) == (
        FinishOutcome.FAILED, RejectionCode.OUTPUT_REFUSED, FinishReason.OUTPUT_REFUSED,
    )
    assert keeps_result(StopReason.OUTPUT_REFUSED)
