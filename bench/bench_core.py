"""Benchmark of the pure core at steady state: ``handle`` decisions per second on one core.

A script, not a test (tests never assert on speed). It builds, for many users, the state one user
holds at steady state under the default policy: about 40 requests per UTC 3-hour window, kept
24 hours after terminal, so about 300 request records per user. Then it times a realistic, time-
ordered, interleaved mix of commands against those states:

- per generation: submit, accept, a lease renewal every ``--renew-every-s``, a terminal report;
- occasionally: a cancel (then a stopped report), a same-key retry while in progress, a repeated
  report (its acknowledgement lost), and a ``ReconcileDue`` every 5 minutes per user that purges
  expired dedup records and retires windows.

Figures, in the same run (the baselines put the main figure in context on this machine):

- ``handle`` (decide + evolve + command memory) decisions/s, the figure with a 50,000/s target;
- bare ``decide`` and bare ``evolve_all`` on the same commands and states;
- ``encode`` of one ``SubmitGeneration`` (orjson), per call;
- the table value per user at steady state (``control_plane.codec``): bytes, dump and load time.

    .venv/bin/python bench/bench_core.py                 # print the figures
    .venv/bin/python bench/bench_core.py --write-docs    # also replace the figures in docs/core.md
    .venv/bin/python bench/bench_core.py --budget-compare --users 20 --warm-hours 6
        # only the token budget off / on comparison (docs/core.md, "Token budget"): decisions/s and
        # the admission p99 (``handle`` of each SubmitGeneration) on the same commands, alternated
"""

from __future__ import annotations

import argparse
import gc
import heapq
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from control_plane.aggregate import Aggregate, handle  # noqa: E402
from control_plane.codec import dump_aggregate, load_aggregate  # noqa: E402
from control_plane.decide import decide, next_deadline_ms  # noqa: E402
from control_plane.evolve import evolve_all  # noqa: E402
from control_plane.ids import generation_id_for  # noqa: E402
from control_plane.policy import HOUR_MS, Policy  # noqa: E402
from schemas import commands as cmd  # noqa: E402
from schemas.codes import CancelReason, FinishOutcome, Tier  # noqa: E402
from schemas.wire import encode  # noqa: E402
from projections.ledger.table_store import EMPTY_LAYOUT, is_chunk_key, join, plan  # noqa: E402
from infra.models.catalog import load_catalog  # noqa: E402

T0_MS = 1_762_441_200_000
REQUESTS_PER_WINDOW = 40
TARGET_DECISIONS_PER_S = 50_000
DOCS = ROOT / "docs" / "core.md"
BEGIN, END = "<!-- bench_core:begin -->", "<!-- bench_core:end -->"


class Workload:
    """A time-ordered command stream for many users, at ~40 requests per user per 3 hours."""

    def __init__(self, users: int, seed: int, renew_every_ms: int, conversations: int = 0) -> None:
        self.rng = random.Random(seed)
        self.users = [f"user-{i:06d}" for i in range(users)]
        # Conversations per user (``--conversations``): every generation is then a turn of one of
        # them in turn (created before the first), answered through the spool and CommitAnswer.
        self.conversations = conversations
        self.revisions: dict[str, int] = {}
        self.turns: dict[str, int] = {}
        self.renew_every_ms = renew_every_ms
        self.reply = cmd.ReplyTo(topic="chatplane.edge-inbox", partition=3, request_id="r")
        self._n = 0
        self._keys = 0

    def _id(self) -> str:
        self._n += 1
        return f"cmd-{self._n:010d}"

    def commands(self, start_ms: int, end_ms: int) -> list[Any]:
        """Every command issued in ``[start_ms, end_ms)`` by every user, interleaved by time."""
        heap: list[tuple[int, int, Any]] = []
        seq = 0
        gap_ms = 3 * HOUR_MS // REQUESTS_PER_WINDOW
        for user in self.users:
            t = start_ms + self.rng.randrange(gap_ms)
            for c in range(self.conversations):
                cid = f"conv-{user}-{c}"
                if cid not in self.revisions:
                    self.revisions[cid] = 0
                    at = start_ms + c
                    heapq.heappush(heap, (at, seq, cmd.CreateConversation(command_id=self._id(), user_id=user, issued_at_ms=at, conversation_id=cid)))
                    seq += 1
            while t < end_ms:
                for at, command in self._generation(user, t):
                    heapq.heappush(heap, (at, seq, command))
                    seq += 1
                t += self.rng.randint(gap_ms // 2, gap_ms * 3 // 2)
            for at in range(start_ms + self.rng.randrange(300_000), end_ms, 300_000):
                heapq.heappush(heap, (at, seq, cmd.ReconcileDue(command_id=self._id(), user_id=user, issued_at_ms=at, as_of_ms=at)))
                seq += 1
        return [heapq.heappop(heap)[2] for _ in range(len(heap))]

    def _generation(self, user: str, t: int) -> list[tuple[int, Any]]:
        rng = self.rng
        self._keys += 1
        key = f"idem-{self._keys:012d}"
        submit_id = self._id()
        generation_id = generation_id_for(user, submit_id)
        worker = f"worker-{rng.randrange(64):03d}"
        submit = dict(
            user_id=user, idempotency_key=key, fingerprint="f" * 43, model_alias="fast-text-model",
            tier=Tier.FREE, stream=True, max_output_tokens=1024, input_tokens=rng.randint(50, 2000),
            reply_to=self.reply,
        )
        cid = ""
        if self.conversations:
            n = self.turns[user] = self.turns.get(user, -1) + 1
            cid = f"conv-{user}-{n % self.conversations}"
            # restore_revision: what the stored row says of a parked conversation (the edge reads it).
            revision = self.revisions[cid]
            submit.update(conversation_id=cid, expected_revision=revision, restore_revision=revision, decide_by_ms=t + 5_000)
            self.revisions[cid] += 2
        out: list[tuple[int, Any]] = [(t, cmd.SubmitGeneration(command_id=submit_id, issued_at_ms=t, **submit))]
        if rng.random() < 0.05:  # the phone's retry while the first is in progress
            out.append((t + 900, cmd.SubmitGeneration(command_id=self._id(), issued_at_ms=t + 900, **submit)))
        attempt = dict(user_id=user, generation_id=generation_id, epoch=1, worker_id=worker, reply_to=self.reply)
        accepted = t + rng.randint(50, 1_500)
        out.append((accepted, cmd.AcceptAttempt(command_id=self._id(), issued_at_ms=accepted, **attempt)))
        duration = rng.randint(5_000, 55_000)
        end = accepted + duration
        cancel_at = accepted + rng.randint(500, duration) if rng.random() < 0.05 else None
        if cancel_at is not None:
            end = cancel_at + rng.randint(20, 400)
            out.append(
                (cancel_at, cmd.CancelGeneration(command_id=self._id(), user_id=user, issued_at_ms=cancel_at,
                                                 generation_id=generation_id, reason=CancelReason.USER, reply_to=self.reply))
            )
        tokens = 0
        for at in range(accepted + self.renew_every_ms, end, self.renew_every_ms):
            tokens += rng.randint(50, 150)
            out.append((at, cmd.RenewLease(command_id=self._id(), issued_at_ms=at, output_tokens=tokens, **attempt)))
        outcome = FinishOutcome.STOPPED if cancel_at is not None else FinishOutcome.COMPLETED
        report = dict(outcome=outcome, input_tokens=submit["input_tokens"], output_tokens=tokens + 40,
                      finish_reason="stop" if outcome is FinishOutcome.COMPLETED else "", **attempt)
        if cid and cancel_at is None:
            report["answer_spooled"] = True
            committed = end + rng.randint(5, 200)  # the history writer stored it
            out.append((committed, cmd.CommitAnswer(command_id=self._id(), user_id=user, issued_at_ms=committed,
                                                    conversation_id=cid, generation_id=generation_id, epoch=1)))
        out.append((end, cmd.ReportAttemptFinished(command_id=self._id(), issued_at_ms=end, **report)))
        if rng.random() < 0.03:  # the finalization acknowledgement was lost: repeated by a new command
            out.append((end + 600, cmd.ReportAttemptFinished(command_id=self._id(), issued_at_ms=end + 600, **report)))
        return out


def run(aggregates: dict[str, Aggregate], commands: list[Any], policy: Policy) -> float:
    """Apply every command with ``handle``; returns the seconds spent."""
    gc.collect()
    started = time.perf_counter()
    for c in commands:
        aggregates[c.user_id] = handle(aggregates[c.user_id], c, policy)[0]
    return time.perf_counter() - started


def split_decide_evolve(aggregates: dict[str, Aggregate], commands: list[Any], policy: Policy) -> tuple[float, float]:
    """Bare ``decide`` and bare ``evolve_all`` seconds over the same commands (each timed alone)."""
    states = {u: a.ledger for u, a in aggregates.items()}
    decide_s = evolve_s = 0.0
    clock = time.perf_counter
    gc.collect()
    for c in commands:
        state = states[c.user_id]
        t0 = clock()
        decision = decide(state, c, policy)
        t1 = clock()
        states[c.user_id] = evolve_all(state, decision.events)
        t2 = clock()
        decide_s += t1 - t0
        evolve_s += t2 - t1
    # Subtract the cost of the clock calls themselves.
    t0 = clock()
    for _ in range(len(commands)):
        clock()
    overhead = (clock() - t0) * 2
    return max(decide_s - overhead / 2, 1e-9), max(evolve_s - overhead / 2, 1e-9)


def processor_whole(aggregates: dict[str, Aggregate], commands: list[Any], policy: Policy) -> tuple[float, int]:
    """What the processor did per command with one whole value per user: handle, the next
    deadline, the whole aggregate encoded. Returns (seconds, changelog bytes written)."""
    gc.collect()
    written = 0
    started = time.perf_counter()
    for offset, c in enumerate(commands):
        after, decision, redelivered = handle(aggregates[c.user_id], c, policy, offset)
        if decision is not None and not redelivered:
            next_deadline_ms(after.ledger, policy)
            written += 8 + len(dump_aggregate(after))
        aggregates[c.user_id] = after
    return time.perf_counter() - started, written


def processor_split(
    aggregates: dict[str, Aggregate], layouts: dict[str, Any], commands: list[Any], policy: Policy
) -> tuple[float, int, int]:
    """The same with projections/ledger/table_store.py's layout (what projections/ledger/processor.py does now):
    handle, the next deadline, ``plan``. Returns (seconds, bytes written, hot-value bytes written)."""
    gc.collect()
    written = hot = 0
    started = time.perf_counter()
    for offset, c in enumerate(commands):
        u = c.user_id
        after, decision, redelivered = handle(aggregates[u], c, policy, offset)
        if decision is not None and not redelivered:
            writes = plan(after, layouts[u], policy)
            layouts[u] = writes.layout
            written += sum(len(v) for _, v in writes.puts)
            hot += len(writes.puts[-1][1])
        aggregates[u] = after
    return time.perf_counter() - started, written, hot


def timed_with_admission_latencies(
    aggregates: dict[str, Aggregate], commands: list[Any], policy: Policy
) -> tuple[float, list[int], int]:
    """``run`` plus each SubmitGeneration's ``handle`` time (ns) and how many of them were refused by
    tokens. Per-command clock reads cost the same for every policy compared."""
    gc.collect()
    latencies: list[int] = []
    refused_by_tokens = 0
    clock = time.perf_counter_ns
    started = time.perf_counter()
    for c in commands:
        t = clock()
        aggregates[c.user_id], decision, _ = handle(aggregates[c.user_id], c, policy)
        if c.type == "SubmitGeneration":
            latencies.append(clock() - t)
            refused_by_tokens += decision.outcome.details.kind == "tokens"
    return time.perf_counter() - started, latencies, refused_by_tokens


def budget_compare(workload: Workload, policy: Policy, warm_end: int, timed_end: int, rounds: int) -> list[str]:
    """The token budget off / on, same commands, same run: decisions/s (best round) and the
    admission p99 (pooled over rounds), alternating policies so that load drifts hit both."""
    warm = workload.commands(T0_MS, warm_end)
    timed = workload.commands(warm_end, timed_end)
    budgets = {
        "off (default)": 0,
        "on, generous (never binds)": 1_000_000,
        "on, binding": 20_000,
    }
    snapshots: dict[str, dict[str, Aggregate]] = {}
    policies: dict[str, Policy] = {}
    for name, budget in budgets.items():
        policies[name] = replace(policy, token_budget_by_tier={Tier.FREE: budget, Tier.PAID: budget})
        aggregates = {u: Aggregate.empty(u) for u in workload.users}
        run(aggregates, warm, policies[name])
        snapshots[name] = aggregates
    results: dict[str, tuple[list[float], list[list[int]], int]] = {name: ([], [], 0) for name in budgets}
    for _ in range(rounds):
        for name in budgets:
            seconds, latencies, refused = timed_with_admission_latencies(dict(snapshots[name]), timed, policies[name])
            runs, per_round, _ = results[name]
            runs.append(seconds)
            per_round.append(latencies)
            results[name] = (runs, per_round, refused)
    n = len(timed)
    submits = sum(c.type == "SubmitGeneration" for c in timed)
    lines = [
        f"{n:,} commands ({submits:,} submits) of {len(workload.users)} users, best of {rounds} rounds alternated:",
        "",
        "| token budget | `handle` decisions/s | admission p50 / p99, all rounds pooled | admission p50 / p99, "
        "each submit's best round | submits refused by tokens |",
        "|---|---|---|---|---|",
    ]

    def p50_p99(values: list[int]) -> str:
        values = sorted(values)
        p50, p99 = values[len(values) // 2], values[min(len(values) - 1, int(len(values) * 0.99))]
        return f"{p50 / 1000:.1f} / {p99 / 1000:.1f} µs"

    for name, (runs, per_round, refused) in results.items():
        pooled = [x for latencies in per_round for x in latencies]
        # The same submit against the same state in every round: its best round leaves out the
        # scheduler's preemptions (the pooled tail on a shared machine is mostly those).
        best = [min(xs) for xs in zip(*per_round)]
        lines.append(f"| {name} | {n / min(runs):,.0f} | {p50_p99(pooled)} | {p50_p99(best)} | {refused:,} |")
    return lines


def per_call_s(fn: Any, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - started) / n)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--warm-hours", type=float, default=27.0, help="history built before timing")
    parser.add_argument("--timed-hours", type=float, default=2.0, help="traffic timed at steady state")
    parser.add_argument("--renew-every-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=0, help="conversations per user (every generation a turn)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the figures in {DOCS.relative_to(ROOT)}")
    parser.add_argument("--budget-compare", action="store_true", help="only the token budget off / on comparison")
    parser.add_argument("--rounds", type=int, default=3, help="--budget-compare: rounds per policy")
    args = parser.parse_args(argv)

    policy = Policy(models=load_catalog().policy_models())  # the shipped catalog: "fast-text-model"
    workload = Workload(args.users, args.seed, int(args.renew_every_s * 1000), args.conversations)
    warm_end = T0_MS + int(args.warm_hours * HOUR_MS)
    timed_end = warm_end + int(args.timed_hours * HOUR_MS)
    if args.budget_compare:
        print("\n".join(budget_compare(workload, policy, warm_end, timed_end, args.rounds)))
        return 0

    t = time.perf_counter()
    aggregates = {u: Aggregate.empty(u) for u in workload.users}
    run(aggregates, workload.commands(T0_MS, warm_end), policy)
    timed = workload.commands(warm_end, timed_end)
    build_s = time.perf_counter() - t
    records = [len(a.ledger.requests) for a in aggregates.values()]
    snapshot = dict(aggregates)

    handle_s = min(run(dict(snapshot), timed, policy) for _ in range(3))
    decide_s, evolve_s = min(
        (split_decide_evolve(dict(snapshot), timed, policy) for _ in range(2)), key=lambda pair: pair[0] + pair[1]
    )
    run(aggregates, timed, policy)  # the states at the end of the timed traffic, for the size figures

    submit = next(c for c in timed if isinstance(c, cmd.SubmitGeneration))
    renew = next(c for c in timed if isinstance(c, cmd.RenewLease))
    encode_submit_s = per_call_s(lambda: encode(submit), 20_000)
    encode_renew_s = per_call_s(lambda: encode(renew), 20_000)
    blobs = {u: dump_aggregate(a) for u, a in aggregates.items()}
    sizes = [len(b) for b in blobs.values()]
    some = list(aggregates.values())[:50]
    dump_s = per_call_s(lambda: [dump_aggregate(a) for a in some], 5) / len(some)
    some_blobs = [blobs[a.ledger.user_id] for a in some]
    load_s = per_call_s(lambda: [load_aggregate(b) for b in some_blobs], 3) / len(some)
    assert all(load_aggregate(blobs[a.ledger.user_id]) == a for a in some)
    deadline_s = per_call_s(lambda: [next_deadline_ms(a.ledger, policy) for a in some], 3) / len(some)
    no_reconcile = [c for c in timed if not isinstance(c, cmd.ReconcileDue)]
    no_reconcile_s = min(run(dict(snapshot), no_reconcile, policy) for _ in range(3))
    # What projections/ledger/processor.py does per command besides handle: the timer's next deadline and
    # the whole table value encoded for the changelog write.
    processor_per_s = 1 / (handle_s / len(timed) + deadline_s + dump_s)

    # The processor's per-command work, whole value (before) vs split layout (now), same commands.
    whole = [processor_whole(dict(snapshot), timed, policy) for _ in range(2)]
    whole_s, whole_bytes = min(whole)
    stored = {u: plan(a, EMPTY_LAYOUT, policy) for u, a in snapshot.items()}
    split_runs = []
    for _ in range(2):
        # Each run starts from the states read back from the table, as after a recovery.
        tables = {u: dict(w.puts) for u, w in stored.items()}
        joined = {u: join(tables[u][u.encode()], tables[u].get, policy) for u in snapshot}
        split_runs.append(
            processor_split({u: j[0] for u, j in joined.items()}, {u: j[1] for u, j in joined.items()}, timed, policy)
        )
    split_s, split_bytes, split_hot = min(split_runs)
    applied = sum(1 for _ in timed)
    hot_sizes = [len(w.puts[-1][1]) for w in stored.values()]
    settled_sizes = [len(v) for w in stored.values() for k, v in w.puts[:-1] if not is_chunk_key(k)]
    join_some = [stored[a.ledger.user_id] for a in some]
    join_s = per_call_s(lambda: [join(dict(w.puts)[w.puts[-1][0]], dict(w.puts).get, policy) for w in join_some], 3) / len(some)

    mix: dict[str, int] = {}
    for c in timed:
        mix[c.type] = mix.get(c.type, 0) + 1
    n = len(timed)
    figures = {
        "handle_per_s": n / handle_s,
        "handle_no_reconcile_per_s": len(no_reconcile) / no_reconcile_s,
        "processor_per_s": processor_per_s,
        "next_deadline_us": deadline_s * 1e6,
        "decide_per_s": n / decide_s,
        "evolve_per_s": n / evolve_s,
        "encode_submit_us": encode_submit_s * 1e6,
        "records_mean": statistics.mean(records),
        "records_max": max(records),
        "state_bytes_mean": statistics.mean(sizes),
        "state_bytes_max": max(sizes),
        "dump_us": dump_s * 1e6,
        "load_us": load_s * 1e6,
    }
    verdict = "met" if figures["handle_per_s"] >= TARGET_DECISIONS_PER_S else "MISSED"
    machine = f"{platform.python_implementation()} {platform.python_version()} on {platform.machine()}, one core"
    mix_text = ", ".join(f"{k} {v / n:.1%}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1]))
    lines = [
        f"Measured {time.strftime('%Y-%m-%d', time.gmtime())} with `.venv/bin/python bench/bench_core.py"
        f"{f' --conversations {args.conversations}' if args.conversations else ''}` "
        f"({machine}; {args.users} users, {args.warm_hours:g} h of history built in {build_s:.0f} s, "
        f"then {n:,} commands of {args.timed_hours:g} h of traffic timed, best of 3).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| `handle` (decide + evolve + memory), steady state | **{figures['handle_per_s']:,.0f} decisions/s** "
        f"(target {TARGET_DECISIONS_PER_S:,}: {verdict}) |",
        f"| `handle`, same mix without its `ReconcileDue` commands | {figures['handle_no_reconcile_per_s']:,.0f} /s |",
        f"| bare `decide`, same commands | {figures['decide_per_s']:,.0f} /s |",
        f"| bare `evolve_all`, same events | {figures['evolve_per_s']:,.0f} /s |",
        f"| `encode` one command (orjson) | {figures['encode_submit_us']:.2f} µs `SubmitGeneration`, "
        f"{encode_renew_s * 1e6:.2f} µs `RenewLease` |",
        f"| request records per user | mean {figures['records_mean']:.0f}, max {figures['records_max']} |",
        f"| table value per user (`dump_aggregate`) | mean {figures['state_bytes_mean'] / 1024:.1f} KiB, "
        f"max {figures['state_bytes_max'] / 1024:.1f} KiB |",
        f"| `dump_aggregate` / `load_aggregate` per state | {figures['dump_us']:,.0f} µs / {figures['load_us']:,.0f} µs |",
        f"| `next_deadline_ms` per state | {figures['next_deadline_us']:,.0f} µs |",
        f"| processor per command, whole value (before): `handle` + `next_deadline_ms` + `dump_aggregate`, measured | "
        f"{n / whole_s:,.0f} commands/s, {whole_bytes / applied / 1024:,.1f} KiB changelog per command |",
        f"| processor per command, split layout (now): `handle` + `table_store.plan` (which derives the next deadline) | "
        f"**{n / split_s:,.0f} commands/s** (x{whole_s / split_s:.1f}), {split_bytes / applied / 1024:,.1f} KiB "
        f"changelog per command ({split_hot / applied / 1024:,.1f} KiB of it the hot value) |",
        f"| split layout per user | hot value mean {statistics.mean(hot_sizes) / 1024:.1f} KiB, max "
        f"{max(hot_sizes) / 1024:.1f} KiB; settled entry mean {statistics.mean(settled_sizes):,.0f} B; "
        f"`join` (read back after a recovery) {join_s * 1e6:,.0f} µs |",
        "",
        f"Command mix: {mix_text}.",
    ]
    print("\n".join(lines))
    if args.write_docs:
        text = DOCS.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        DOCS.write_text(f"{head}{BEGIN}\n" + "\n".join(lines) + f"\n{END}{tail}")
        print(f"wrote {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
