"""The seeded chaos run: the whole stack under a steady mixed load and a schedule of faults,
ending in an audit of everything the clients saw against the ledger.

    python -m tests.chaos.chaos --seed 7 --duration-s 600          # the 10-minute local run
    python -m tests.chaos.chaos --seed 7 --duration-s 0 --slot-s 12     # one round of faults: what CI runs (tests/chaos/test_chaos.py)

A run lasts at least one round (every fault kind once, a slot each: ``round_duration_s``); a shorter
``--duration-s`` (0 included) is lengthened to that, so no seed's plan leaves a kind out.

The stack (bench/stackrun.py): its own Kafka broker and Cassandra node on private ports, two admission
processors, two ``sim`` workers, two edges, one read-model projection, one history writer, each its real entry point as
``make up`` starts it. The load: client loops over HTTP against both edges (streams read to the end,
non-streams, cancels after the first words, same-key retries from a second client on the other edge,
client disconnects mid-stream, slow SSE readers, users that exhaust their quota: ``infra.harness.load``,
shared with bench/soak.py). The faults, in an order and at offsets drawn from the seed: kill -9 and
restart of every component, a restart of the broker and of Cassandra, a worker that stalls (SIGSTOP for a while). At the end the load stops, the
stack settles, the processors stop, and the checks run:

* ``projections.ledger.audit`` over the whole ledger (and the processors' table): no violation, no
  double consume, no reservation RESERVED past its deadline, no slot held by a finished generation;
* every generation a client saw admitted is settled in GET (one terminal state, or
  ``admission_retryable``, which holds nothing) and the ledger agrees: one terminal event, and its
  message consumed exactly once when an attempt was accepted, never otherwise;
* no client saw an untyped error or a 5xx outside the typed ones; every stream ended in exactly one
  terminal event, or in EOF only where its edge was killed; a connection broke only on a killed edge;
* no engine kept working for a client that was gone: a generation whose edge died ended within the
  edge lease + lost-edge grace + ``ORPHAN_BOUND_MS``; one whose client hung up within the disconnect
  grace + ``ORPHAN_BOUND_MS``; either plus the time the broker was down after the reader left (no
  cancel can be appended then);
* same-key retries from two clients named one generation.

The seed, the fault schedule (planned, and as it ran) and the figures are printed; the same seed
gives the same schedule (the load's timing, and so its exact counts, vary from run to run). Exit
status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.stackrun import Stack  # noqa: E402
from control_plane.invariants import check_state  # noqa: E402
from control_plane.policy import Policy  # noqa: E402
from projections.ledger.audit import audit  # noqa: E402
from infra.harness.load import SIM_ENV, TERMINAL_SSE, Load, Outcome, now_ms  # noqa: E402
from infra.runtime.topic_reader import read_topic  # noqa: E402
from schemas import events as ev  # noqa: E402
from schemas.codes import RejectionCode, ReservationState  # noqa: E402
from schemas.wire import decode_ledger_entry  # noqa: E402

# Timing of the stack under test (the product's defaults unless named here).
EDGE_LEASE_MS = 3_000  # CHATPLANE_EDGE_PRESENCE_LEASE_MS (default)
EDGE_LOST_GRACE_MS = 5_000  # CHATPLANE_EDGE_LOST_GRACE_MS (default)
DISCONNECT_GRACE_MS = 5_000  # CHATPLANE_EDGE_DISCONNECT_GRACE_S (default)
# What ending an orphan may take beyond its grace: a timer tick to notice, the cancel's decision,
# the stop reaching the worker, the engine stopping between two tokens, the report's decision; and
# a fault of the schedule that lands meanwhile (a processor's partitions move in a rebalance, about
# one session timeout).
ORPHAN_BOUND_MS = 15_000
# Faults that stop the cancel path itself: while the broker is down no detach, cancel or stop can be
# appended or read, so an orphan's allowance grows by the part of the outage (as it ran, restart
# included) that fell after its reader left. Nothing else extends it.
LOG_OUTAGE_KINDS = frozenset({"restart_kafka"})
SETTLE_TIMEOUT_S = 240.0
RESULT_LATER_WAIT_S = 30.0  # for results held by a worker while Cassandra was down
FAULT_DOWN_S = (2.0, 5.0)  # a killed component stays down this long before its restart
SERVER_DOWN_S = (3.0, 8.0)
STALL_S = (6.0, 12.0)
# A seed taken from a commit id: its first 6 hex digits (0 to 16,777,215), short enough to read
# and to name the run's namespace and keyspace.
COMMIT_SEED_HEX_DIGITS = 6
GIT_TIMEOUT_S = 10.0
SETTLED = {"completed", "cancelled", "failed", "admission_retryable"}
TYPED_CODES = {c.value for c in RejectionCode}
# 5xx answers the seed types (section 5): anything else with a 5xx status is a defect.
# result_pending: a same-key retry or GET of a completed generation whose text is not readable yet (the
# worker holds it for a later write, or the read model has not projected the completion): retry shortly.
TYPED_5XX = {"quota_service_unavailable", "capacity_exhausted", "model_backend_error", "generation_timeout", "result_pending"}


# ------------------------------------------------------------------------------------------------
# the fault schedule


@dataclass
class Fault:
    at_s: float  # planned offset from the start of the load
    kind: str  # kill9 | stall | restart_kafka | restart_cassandra
    target: str
    down_s: float
    started_ms: int = 0
    ended_ms: int = 0
    note: str = ""


def fault_kinds(components: list[str]) -> list[tuple[str, str]]:
    """One round of faults, as (kind, target): a kill -9 of every component, a restart of the broker
    and of Cassandra, and the first worker stalled."""
    kinds = [("kill9", c) for c in components] + [("restart_kafka", "kafka"), ("restart_cassandra", "cassandra")]
    kinds += [("stall", w) for w in components if w.startswith("worker-")][:1]
    return kinds


def round_duration_s(components: list[str], slot_s: float) -> float:
    """The shortest run whose plan holds one whole round: the first fault half a slot in, then one
    slot per fault kind. Derived from the kinds, so a component added to the stack lengthens it."""
    return len(fault_kinds(components)) * slot_s + slot_s / 2


def run_duration_s(requested_s: float | None, components: list[str], slot_s: float) -> float:
    """The run's length: the one asked for, or one round when none is asked for or the one asked
    for is shorter (a shorter run would leave some kind of fault out)."""
    return max(requested_s or 0.0, round_duration_s(components, slot_s))


def plan_faults(seed: int, duration_s: float, components: list[str], slot_s: float) -> list[Fault]:
    """One round = every fault kind once, in a seeded order; as many rounds as fit in the run, the
    first always whole (a run shorter than ``round_duration_s`` is refused, never planned short)."""
    if duration_s < round_duration_s(components, slot_s):
        raise ValueError(
            f"{duration_s} s at {slot_s} s a slot holds fewer than the {len(fault_kinds(components))} fault kinds: "
            f"at least {round_duration_s(components, slot_s)} s")
    rng = random.Random(seed)
    kinds = fault_kinds(components)
    faults: list[Fault] = []
    t = slot_s / 2
    while t < duration_s - slot_s / 2:
        round_ = kinds[:]
        rng.shuffle(round_)
        for kind, target in round_:
            if t >= duration_s - slot_s / 2:
                break
            if kind == "kill9":
                down = rng.uniform(*FAULT_DOWN_S)
            elif kind == "stall":
                down = rng.uniform(*STALL_S)
            else:
                down = rng.uniform(*SERVER_DOWN_S)
            faults.append(Fault(round(t + rng.uniform(0, slot_s / 4), 1), kind, target, round(down, 1)))
            t += slot_s
    return faults


class Injector:
    """Runs the schedule against the stack, one fault at a time (the next waits for the last to heal)."""

    def __init__(self, stack: Stack, faults: list[Fault]) -> None:
        self.stack, self.faults = stack, faults
        self.down: dict[str, list[tuple[int, int]]] = {}  # edge name -> [(killed_ms, back_ms)]
        self.t0_ms = 0  # wall clock at the start of the load (offsets in the findings)

    def edge_killed_between(self, edge: str, t0_ms: int, t1_ms: int) -> int | None:
        for killed, back in self.down.get(edge, []):
            if killed <= t1_ms and (back == 0 or back >= t0_ms):
                return killed
        return None

    async def run(self, t0: float) -> None:
        self.t0_ms = now_ms() - int((time.monotonic() - t0) * 1000)
        for f in self.faults:
            await asyncio.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
            f.started_ms = now_ms()
            print(f"[chaos] {time.monotonic() - t0:6.1f}s fault {f.kind} {f.target} ({f.down_s} s)", flush=True)
            try:
                await self._inject(f)
            except Exception as exc:  # noqa: BLE001 - recorded; the checks decide
                f.note = f"injection failed: {exc!r}"[:300]
                print(f"[chaos] {f.note}", flush=True)
            f.ended_ms = now_ms()

    async def _inject(self, f: Fault) -> None:
        s = self.stack
        if f.kind == "kill9":
            s.kill(f.target)
            if f.target.startswith("edge-"):
                self.down.setdefault(f.target, []).append((f.started_ms, 0))
            await asyncio.sleep(f.down_s)
            s.components[f.target].start()
            await s.wait_ready(f.target)
            if f.target.startswith("edge-"):
                killed, _ = self.down[f.target][-1]
                self.down[f.target][-1] = (killed, now_ms())
        elif f.kind == "stall":
            s.pause(f.target)
            await asyncio.sleep(f.down_s)
            s.resume(f.target)
        else:
            server = f.kind.removeprefix("restart_")
            await asyncio.to_thread(s.stop_server, server)
            await asyncio.sleep(f.down_s)
            t = time.monotonic()
            await asyncio.to_thread(s.start_server, server)
            f.note = f"ready {time.monotonic() - t:.1f} s after its start"


# ------------------------------------------------------------------------------------------------
# the checks


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def bad(self, what: str) -> None:
        self.problems.append(what)


# GET's codes for a completed generation whose text is not in the result store (docs/edge.md).
NOT_STORED_CODES = frozenset({"result_pending", "result_unavailable"})


async def settle(stack: Stack, outcomes: list[Outcome], timeout_s: float) -> dict[str, dict[str, Any]]:
    """GET every generation a client saw, until each is settled or the time is up; the last documents."""
    owners = {o.generation_id: o.user for o in outcomes if o.generation_id}
    docs: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    pending = set(owners)
    async with httpx.AsyncClient(base_url=stack.edge_urls[0], timeout=10) as http:
        while pending and time.monotonic() < deadline:
            for gid in sorted(pending):
                with contextlib.suppress(httpx.HTTPError):
                    resp = await http.get(f"/v1/generations/{gid}",
                                          headers={"Authorization": f"Bearer {stack.token(owners[gid])}"})
                    doc = resp.json()
                    # A completed generation whose text the result store does not hold answers 503
                    # result_pending (the worker holds it for a later write) or 410 result_unavailable,
                    # with its status beside the code (docs/edge.md).
                    error = doc.get("error") or {}
                    docs[gid] = {"http": resp.status_code, "status": doc.get("status") or error.get("status"),
                                 "code": error.get("code", "")}
                    status = docs[gid]["status"]
                    if status in SETTLED:
                        pending.discard(gid)
            if pending:
                await asyncio.sleep(1.0)
        # A completed result the worker could not store while Cassandra was down is written later
        # (workers/result_sink.py): until then GET answers 503 result_pending. Give it its time.
        unstored = {gid for gid, d in docs.items() if d.get("code") in NOT_STORED_CODES}
        deadline = time.monotonic() + RESULT_LATER_WAIT_S
        while unstored and time.monotonic() < deadline:
            await asyncio.sleep(2.0)
            for gid in sorted(unstored):
                with contextlib.suppress(httpx.HTTPError):
                    resp = await http.get(f"/v1/generations/{gid}",
                                          headers={"Authorization": f"Bearer {stack.token(owners[gid])}"})
                    if resp.status_code == 200:
                        docs[gid] = {"http": 200, "status": resp.json().get("status"), "code": "", "stored_later": True}
                        unstored.discard(gid)
    return docs


async def ledger_by_generation(stack: Stack) -> dict[str, list[Any]]:
    seen: set[str] = set()
    out: dict[str, list[Any]] = {}
    for _, _, _, value in sorted(await read_topic(stack.bootstrap, stack.topology.ledger), key=lambda r: (r[0], r[1])):
        for e in decode_ledger_entry(value or b"").events:
            if e.event_id in seen:
                continue
            seen.add(e.event_id)
            out.setdefault(e.generation_id, []).append(e)
    return out


def overlap_ms(f: Fault, t0_ms: int, t1_ms: int) -> int:
    """How much of [t0_ms, t1_ms] the fault ran (one still running runs to t1_ms; one not begun, 0)."""
    if not f.started_ms:
        return 0
    return max(0, min(f.ended_ms or t1_ms, t1_ms) - max(f.started_ms, t0_ms))


def log_outage_ms(faults: list[Fault], gone_ms: int, end_ms: int) -> int:
    """How much of [gone_ms, end_ms] the broker was down or restarting (``LOG_OUTAGE_KINDS``)."""
    return sum(overlap_ms(f, gone_ms, end_ms) for f in faults if f.kind in LOG_OUTAGE_KINDS)


def check(stack: Stack, load: Load, injector: Injector, docs: dict[str, dict[str, Any]],
          ledger: dict[str, list[Any]], report: Any) -> Findings:
    fx = Findings()
    outs = load.outcomes
    # -- what the clients saw ------------------------------------------------------------------------
    for o in outs:
        if o.code == "<untyped>" or (o.code and o.code not in TYPED_CODES):
            fx.bad(f"untyped error: {o.kind} {o.status} on {o.edge} at {o.started_ms}")
        if o.status >= 500 and o.code not in TYPED_5XX:
            fx.bad(f"5xx outside the typed ones: {o.kind} {o.status} {o.code} on {o.edge}")
        if o.ending in ("eof", "broken", "connect") and o.edge:
            if injector.edge_killed_between(o.edge, o.started_ms, o.ended_ms) is None:
                fx.bad(f"{o.kind} ended {o.ending} on {o.edge}, which was not killed ({o.generation_id or o.key})")
        if o.events and o.ending != "hung_up":
            terminal = [name for name in o.events if name in TERMINAL_SSE]
            if len(terminal) > 1:
                fx.bad(f"stream {o.generation_id} carried {len(terminal)} terminal events: {terminal}")
    # -- every admitted generation settled, and the ledger agrees ------------------------------------
    charged_wrong = double = unsettled = 0
    for gid in {o.generation_id for o in outs if o.generation_id}:
        status = docs.get(gid, {}).get("status")
        events = ledger.get(gid, [])
        terminal = [e for e in events if isinstance(e, ev.TERMINAL_EVENT_TYPES)]
        consumed = sum(isinstance(e, ev.ReservationConsumed) for e in events)
        accepted = any(isinstance(e, ev.AttemptAccepted) for e in events)
        if status not in SETTLED:
            unsettled += 1
            fx.bad(f"{gid} not settled in GET: {docs.get(gid)}; ledger: {[type(e).__name__ for e in events]}")
            continue
        if status == "admission_retryable":
            if terminal or consumed:
                fx.bad(f"{gid} admission_retryable in GET but the ledger has {len(terminal)} terminal, {consumed} consumed")
        elif len(terminal) != 1 or type(terminal[0]).__name__.removeprefix("Generation").lower() != status:
            fx.bad(f"{gid}: GET says {status}, the ledger ends {[type(e).__name__ for e in terminal]}")
        if consumed > 1:
            double += 1
            fx.bad(f"{gid}: message consumed {consumed} times")
        if consumed != (1 if accepted else 0):
            charged_wrong += 1
            fx.bad(f"{gid}: consumed {consumed} with an accepted attempt: {accepted}")
    # -- orphans: a generation whose reader was gone ended within its grace + the bound ----------------
    orphan_ms: list[int] = []
    in_outage: list[tuple[int, int]] = []  # (ran on, of which the broker was down) for orphans an outage overlapped
    for o in outs:
        if not o.generation_id or o.kind == "cancel_call":
            continue
        if o.ending == "hung_up":
            gone_ms, grace = o.hung_up_ms, DISCONNECT_GRACE_MS
        elif o.ending in ("eof", "broken") and o.edge:
            killed = injector.edge_killed_between(o.edge, o.started_ms, o.ended_ms)
            if killed is None:
                continue
            gone_ms, grace = killed, EDGE_LEASE_MS + EDGE_LOST_GRACE_MS
        else:
            continue
        ends = [e.occurred_at_ms for e in ledger.get(o.generation_id, []) if isinstance(e, ev.TERMINAL_EVENT_TYPES)]
        if not ends:
            continue  # reported above as unsettled or admission_retryable
        took = ends[0] - gone_ms
        orphan_ms.append(took)
        outage = log_outage_ms(injector.faults, gone_ms, ends[0])
        if outage:
            in_outage.append((took, outage))
        if took > grace + ORPHAN_BOUND_MS + outage:
            terminal = next(e for e in ledger[o.generation_id] if isinstance(e, ev.TERMINAL_EVENT_TYPES))
            overlapping = [f"{f.kind} {f.target} at {(f.started_ms - injector.t0_ms) / 1000:.1f}s"
                           f" for {((f.ended_ms or ends[0]) - f.started_ms) / 1000:.1f}s"
                           for f in injector.faults if overlap_ms(f, gone_ms, ends[0])]
            fx.bad(f"{o.generation_id}: its reader was gone ({o.ending}, on {o.edge} at "
                   f"{(gone_ms - injector.t0_ms) / 1000:.1f}s) but it ran {took} ms on (grace {grace} + "
                   f"{ORPHAN_BOUND_MS} + broker outage {outage}); it ended {type(terminal).__name__}; "
                   f"faults meanwhile: {overlapping or 'none'}")
    # -- same-key retries from two clients -------------------------------------------------------------
    pairs: dict[tuple[str, str], set[str]] = {}
    for o in outs:
        if o.kind in ("retry_a", "retry_b") and o.generation_id:
            pairs.setdefault((o.user, o.key), set()).add(o.generation_id)
    for (user, key), gids in pairs.items():
        if len(gids) > 1:
            fx.bad(f"one key, two generations: {user} {key} -> {sorted(gids)}")
    # -- the audit ---------------------------------------------------------------------------------------
    now = now_ms()
    reserved_late = [r.reservation_id for s in report.states.values() for r in s.reservations.values()
                     if r.state is ReservationState.RESERVED and r.reconcile_deadline_ms < now]
    state_violations = [str(v) for s in report.states.values() for v in check_state(s, Policy().concurrency_limit)]
    if not report.ok:
        fx.bad("audit failed:\n" + report.render())
    if reserved_late:
        fx.bad(f"{len(reserved_late)} reservations RESERVED past their deadline: {reserved_late[:5]}")
    if state_violations:
        fx.bad(f"state violations after settling: {state_violations[:5]}")
    fx.figures.update(
        requests=len([o for o in outs if o.kind != "cancel_call"]),
        outcomes=dict(Counter(f"{o.kind}:{o.status or o.ending}:{o.code or '-'}" for o in outs).most_common()),
        stream_endings=dict(Counter(f"{o.kind}:{o.ending}" for o in outs if o.events or o.ending in ("hung_up", "eof"))),
        generations_seen=len({o.generation_id for o in outs if o.generation_id}),
        get_status=dict(Counter(d.get("status") for d in docs.values())),
        # Completed, but the worker could not store the text (Cassandra down past its put budget,
        # workers/result_sink.py): GET answers 503 result_pending, then 410 result_unavailable; the
        # ledger is unaffected.
        results_not_stored=sum(d.get("code") in NOT_STORED_CODES for d in docs.values()),
        results_stored_later=sum(bool(d.get("stored_later")) for d in docs.values()),
        unsettled=unsettled, double_consumes=double, charged_wrong=charged_wrong,
        reserved_past_deadline=len(reserved_late), same_key_pairs=len(pairs),
        orphans=len(orphan_ms), orphan_end_ms_max=max(orphan_ms, default=0),
        orphan_end_ms_p50=sorted(orphan_ms)[len(orphan_ms) // 2] if orphan_ms else 0,
        orphans_in_broker_outage=sorted(in_outage),
        audit_violations=len(report.violations), audit_mismatches=len(report.mismatches),
        ledger_consumed=report.consumed, ledger_released=report.released, ledger_terminal=dict(report.terminal),
    )
    return fx


# ------------------------------------------------------------------------------------------------
# the run


@dataclass
class Result:
    seed: int
    ok: bool
    problems: list[str]
    figures: dict[str, Any]
    faults: list[dict[str, Any]]
    work_dir: str


def chaos_stack(seed: int, work_dir: Path, env: dict[str, str] | None = None) -> Stack:
    """The stack a run faults (built, nothing started): its component names plan the faults."""
    return Stack(work_dir, namespace=f"chaos{seed}", env={**SIM_ENV, **(env or {})})


def seed_from_commit(commit: str) -> int:
    """A run's seed from a git commit id: each commit explores another fault schedule, and the
    same commit (or the printed seed) replays it."""
    return int(commit[:COMMIT_SEED_HEX_DIGITS], 16)


def head_commit() -> str | None:
    """The checkout's commit id, or None outside a git checkout."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


async def chaos(seed: int, duration_s: float | None, work_dir: Path, loops: int = 8, heavy_loops: int = 1,
                slot_s: float = 20.0, env: dict[str, str] | None = None) -> Result:
    """One run; ``duration_s`` None (or shorter than one round of faults) runs exactly one round."""
    stack = chaos_stack(seed, work_dir, env)
    components = sorted(stack.components)
    asked_s, duration_s = duration_s, run_duration_s(duration_s, components, slot_s)
    if asked_s is not None and duration_s > asked_s:
        print(f"[chaos] {asked_s:.0f} s holds fewer slots of {slot_s:.0f} s than the {len(fault_kinds(components))} "
              f"fault kinds: running {duration_s:.0f} s", flush=True)
    faults = plan_faults(seed, duration_s, components, slot_s)
    print(f"[chaos] seed {seed}, {duration_s:.0f} s of load, work dir {work_dir}", flush=True)
    print("[chaos] schedule: " + "; ".join(f"{f.at_s}s {f.kind} {f.target} {f.down_s}s" for f in faults), flush=True)
    t_boot = time.monotonic()
    await stack.start()
    print(f"[chaos] stack up in {time.monotonic() - t_boot:.1f} s: {sorted(stack.pids())}", flush=True)
    load = Load(stack, seed, loops, heavy_loops)
    injector = Injector(stack, faults)
    try:
        t0 = time.monotonic()
        load_task = asyncio.create_task(load.run())
        await injector.run(t0)
        await asyncio.sleep(max(0.0, t0 + duration_s - time.monotonic()))
        load.stopping.set()
        await load_task
        print(f"[chaos] load stopped after {time.monotonic() - t0:.1f} s, {len(load.outcomes)} calls; settling", flush=True)
        for c in stack.components.values():  # anything a fault left down comes back for the settle
            if not c.alive():
                c.start()
        await stack.wait_admission()
        t_settle = time.monotonic()
        docs = await settle(stack, load.outcomes, SETTLE_TIMEOUT_S)
        settle_s = time.monotonic() - t_settle
        # The audit compares the table with the ledger: nothing may decide meanwhile (a processor's
        # timer would), so the processors stop first.
        for c in stack.of_kind("processor"):
            c.stop()
        ledger = await ledger_by_generation(stack)
        report = await audit(stack.bootstrap, stack.topology, concurrency_limit=Policy().concurrency_limit,
                             dedup_retention_ms=Policy().dedup_retention_ms)
        findings = check(stack, load, injector, docs, ledger, report)
        findings.figures["settle_s"] = round(settle_s, 1)
        findings.figures["faults"] = dict(Counter(f.kind for f in faults))
        print(report.render(), flush=True)
    finally:
        await load.close()
        stack.stop()
    return Result(seed, not findings.problems, findings.problems, findings.figures, [asdict(f) for f in faults], str(work_dir))


def render(r: Result) -> str:
    lines = [f"chaos run, seed {r.seed}: {'PASSED' if r.ok else 'FAILED'}", "faults injected (as they ran):"]
    for f in r.faults:
        took = (f["ended_ms"] - f["started_ms"]) / 1000 if f["ended_ms"] else 0
        lines.append(f"  {f['at_s']:6.1f}s {f['kind']:<17} {f['target']:<12} down {f['down_s']:4.1f}s, healed in {took:5.1f}s {f['note']}")
    for k, v in r.figures.items():
        lines.append(f"{k}: {v}")
    lines.append(f"problems: {len(r.problems)}")
    lines.extend(f"  {p}" for p in r.problems[:50])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="seconds of load and faults (600: the local run); at least one round of every fault kind, 0: exactly one")
    p.add_argument("--loops", type=int, default=8, help="client loops (each one request at a time)")
    p.add_argument("--heavy-loops", type=int, default=1, help="loops of users that exhaust their quota")
    p.add_argument("--slot-s", type=float, default=20.0, help="seconds between two faults")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting for every component of the stack (repeatable), e.g. CHATPLANE_EDGE_LOST_GRACE_MS=60000")
    p.add_argument("--work-dir", type=Path, help="kept afterwards (default: a temporary one, removed when it passed)")
    a = p.parse_args(argv)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix=f"chatplane-chaos-{a.seed}-"))
    env = dict(item.split("=", 1) for item in a.env)
    result = asyncio.run(chaos(a.seed, a.duration_s, work, a.loops, a.heavy_loops, a.slot_s, env))
    print(render(result))
    (work / "result.json").write_text(json.dumps(asdict(result), indent=2, default=str))
    if result.ok and a.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
