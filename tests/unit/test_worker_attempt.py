"""The worker's attempt as a state machine (``workers.attempt.Attempt``) and its closed vocabularies:
every state reachable and able to end, every stop and failure reported with a wire ``FinishReason``,
and the wire's finish reason closed but still reading what was recorded before it was closed.
No broker: nothing here connects (the attempt itself runs in ``tests/integration/test_workers.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from schemas import commands as cmd
from schemas.codes import FinishOutcome, FinishReason, RejectionCode
from schemas.wire import WireError, decode_command
from workers.attempt import (
    _NEXT_STATES,
    Attempt,
    AttemptFailure,
    AttemptState,
    StopReason,
    failure_report,
    keeps_result,
    stop_report,
)

FINAL_STATES = {AttemptState.REPORTED, AttemptState.GAVE_UP}


def reachable(start: AttemptState) -> set[AttemptState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in _NEXT_STATES[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_taken_and_can_reach_a_final_state():
    assert reachable(AttemptState.TAKEN) == set(AttemptState)
    for state in AttemptState:
        assert reachable(state) & FINAL_STATES, state
    assert all(not _NEXT_STATES[s] for s in FINAL_STATES)


def test_a_transition_outside_the_table_fails_loudly():
    attempt = Attempt(SimpleNamespace(settings=None), SimpleNamespace(generation_id="gen_x", epoch=1), None)  # type: ignore[arg-type]
    attempt._to(AttemptState.PROMPT_REQUESTED)
    with pytest.raises(AssertionError, match="PROMPT_REQUESTED -> RUNNING"):
        attempt._to(AttemptState.RUNNING)


@pytest.mark.parametrize("reason", list(StopReason))
def test_every_stop_reason_is_reported_with_a_code_exactly_when_it_failed(reason: StopReason):
    outcome, code, finish = stop_report(reason)
    assert isinstance(finish, FinishReason) and finish is not FinishReason.NONE
    assert (code is not None) == (outcome is FinishOutcome.FAILED)


def test_stop_reasons_keep_their_wire_names_except_max_tokens_which_is_a_length_completion():
    for reason in StopReason:
        finish = stop_report(reason)[2]
        assert finish == (FinishReason.LENGTH if reason is StopReason.MAX_OUTPUT_TOKENS else reason.value)
    assert stop_report(StopReason.MAX_OUTPUT_TOKENS)[0] is FinishOutcome.COMPLETED
    assert stop_report(StopReason.CANCEL)[0] is FinishOutcome.STOPPED


@pytest.mark.parametrize("failure", list(AttemptFailure))
def test_every_failure_is_reported_under_its_own_name(failure: AttemptFailure):
    code, finish = failure_report(failure)
    assert finish.value == failure.value
    expected = RejectionCode.GENERATION_TIMEOUT if failure is AttemptFailure.GENERATION_DURATION_MAX else RejectionCode.MODEL_BACKEND_ERROR
    assert code is expected


def test_no_result_is_written_for_an_epoch_that_is_no_longer_ours():
    assert {r for r in StopReason if not keeps_result(r)} == {StopReason.FENCED, StopReason.LEASE_LOST}
    assert keeps_result(None)


def report(**fields: object) -> bytes:
    command = cmd.ReportAttemptFinished(
        command_id="c1", user_id="u1", issued_at_ms=1, generation_id="gen_x", epoch=1, worker_id="w1",
        outcome=FinishOutcome.FAILED, input_tokens=1, output_tokens=2,
    )
    doc = orjson.loads(orjson.dumps(command))
    doc.update(fields)
    return orjson.dumps(doc)


def test_finish_reason_on_the_wire_is_closed_and_reads_the_empty_default():
    assert decode_command(report(finish_reason="")).finish_reason is FinishReason.NONE
    doc = orjson.loads(report())
    del doc["finish_reason"]
    assert decode_command(orjson.dumps(doc)).finish_reason is FinishReason.NONE
    assert decode_command(report(finish_reason="engine_stalled")).finish_reason is FinishReason.ENGINE_STALLED
    with pytest.raises(WireError, match="finish_reason"):
        decode_command(report(finish_reason="simulated crash after 5 tokens"))
