"""What a worker tells the edges about its work, beyond counts (seed section 7).

The seed: "Estimate work from input tokens, the maximum output budget, active sequences, queue age,
KV-cache pressure, model compatibility, and measured service times. A short prompt and a
hundred-thousand-token prompt should not count as equal work." A worker knows each attempt it
holds (its input tokens and output budget, from the dispatch) and measures its engine; it puts
into every ``WorkerHeartbeat``:

- ``prefill_tokens_per_s``: input tokens per second of prefill, measured (the time from the engine's
  start to its first token), an exponentially weighted mean over attempts (``RATE_EWMA_ALPHA``);
- ``decode_tokens_per_s``: output tokens per second of one sequence after its first token, likewise;
- ``output_fill``: the share of the output budget generations end up using (a budget is an upper
  bound: most answers stop well before it), likewise, starting at 1 (the whole budget);
- ``queued_input_tokens`` / ``queued_output_tokens``: the prefill and the expected output of the
  attempts taken but not yet running here (fetching the prompt, being accepted);
- ``output_tokens_left``: the expected output still to decode of the running attempts (their
  expected output minus what each produced; at least one token each);
- ``kv_tokens_free``: ``CHATPLANE_WORKER_KV_TOKENS_MAX`` minus the tokens the held attempts may fill
  (input plus expected output), or -1 when that bound is not configured (unknown);
- ``dispatch_backlog`` and ``queue_age_ms``: dispatches waiting in this worker's dispatch partitions
  (the log end it last saw minus the next offset it takes), and how long the last one it took had
  waited on the log (0 while nothing waits).

The edge turns these into a queue-wait estimate (``edge.capacity.CapacityView``). Model
compatibility is the pool: a heartbeat counts only for the pool its worker serves.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest attempt in the measured rates: about the last 10-20 attempts count.
RATE_EWMA_ALPHA = 0.1
# Attempts shorter than this (from engine start to first token, or first token to end) are not
# measured: timer resolution and scheduling noise would dominate their rate.
RATE_SAMPLE_MIN_S = 0.005


def _ewma(current: float, sample: float) -> float:
    return sample if current <= 0 else current + RATE_EWMA_ALPHA * (sample - current)


@dataclass
class WorkRates:
    """The engine's measured service rates on this worker (0: not measured yet)."""

    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    output_fill: float = 1.0

    def observe(
        self,
        input_tokens: int,
        output_budget: int,
        output_tokens: int,
        started_at: float | None,
        first_token_at: float | None,
        ended_at: float | None,
        ran_to_its_end: bool,
    ) -> None:
        """One finished attempt. ``ran_to_its_end``: not stopped by a cancel, lease or shutdown (only
        those tell how much of its budget a generation uses)."""
        if started_at is not None and first_token_at is not None and input_tokens > 0:
            prefill_s = first_token_at - started_at
            if prefill_s >= RATE_SAMPLE_MIN_S:
                self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, input_tokens / prefill_s)
        if first_token_at is not None and ended_at is not None and output_tokens > 1:
            decode_s = ended_at - first_token_at
            if decode_s >= RATE_SAMPLE_MIN_S:
                self.decode_tokens_per_s = _ewma(self.decode_tokens_per_s, (output_tokens - 1) / decode_s)
        if ran_to_its_end and output_budget > 0:
            fill = min(1.0, output_tokens / output_budget)
            self.output_fill += RATE_EWMA_ALPHA * (fill - self.output_fill)

    def expected_output(self, output_budget: int) -> int:
        """The output tokens an attempt with this budget is expected to produce (at least 1)."""
        return max(1, round(output_budget * self.output_fill))


@dataclass(frozen=True, slots=True)
class HeldWork:
    """The work of the attempts a worker holds, summed for one heartbeat."""

    queued_input_tokens: int = 0
    queued_output_tokens: int = 0
    output_tokens_left: int = 0
    tokens_held: int = 0  # input + expected output of every held attempt (what its KV cache may fill)


def held_work(rates: WorkRates, attempts: list[tuple[bool, int, int, int]]) -> HeldWork:
    """``attempts``: (running, input tokens, output budget, output tokens so far) of each held attempt."""
    queued_in = queued_out = left = held = 0
    for running, input_tokens, budget, produced in attempts:
        expected = rates.expected_output(budget)
        held += input_tokens + max(expected, produced)
        if running:
            left += max(1, expected - produced)
        else:
            queued_in += input_tokens
            queued_out += expected
    return HeldWork(queued_in, queued_out, left, held)
