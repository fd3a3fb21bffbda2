"""The audit tool: replay the ledger through ``evolve``, check every invariant, compare with the table.

    python -m projections.ledger.audit [--bootstrap HOST:PORT] [--namespace NS] [--from-offset N | --from-time ISO]
                                [--no-table] [--json]

Reads every partition of LEDGER from the beginning (or an offset or time) to its end offset at
start, de-duplicates events by id (a reused id with different content is a violation), checks the
invariants of ``control_plane.invariants`` after each entry, rebuilds each user's state, and compares
it with the processor's table (the latest value per user in its changelog). Prints a report and exits
1 on any violation or mismatch. Older schema versions are upgraded by ``schemas.wire`` on decode.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from control_plane.evolve import billable_of
from control_plane.invariants import InvariantMonitor, Violation, check_state
from control_plane.policy import Policy
from control_plane.state import UserLedger
from schemas import events as ev
from infra.runtime.settings import env_value, kafka_bootstrap
from infra.runtime.topic_reader import read_topic
from projections.ledger.table_store import join_table
from schemas.topics import Topology
from schemas.wire import WireError, decode_ledger_entry



@dataclass
class AuditReport:
    entries_read: int = 0
    events_read: int = 0
    duplicate_events: int = 0
    undecodable: list[str] = field(default_factory=list)
    users: int = 0
    terminal: Counter[str] = field(default_factory=Counter)
    consumed: int = 0
    released: int = 0
    # Submits refused, holding nothing, because the processor read them after their decision deadline
    # (their edge had answered 503 quota_service_unavailable).
    refused_late: int = 0
    # Token reservations (docs/core.md, "Token budget"): admitted, settled (each once: a second
    # settlement is a violation, invariant 12), still held when the audit ended (generations still
    # running or queued; none once the system is idle), and the tokens the usage records charged.
    token_reservations: int = 0
    token_settlements: int = 0
    tokens_unsettled: int = 0
    tokens_billable: int = 0
    tokens_overshoot: int = 0
    violations: list[Violation] = field(default_factory=list)
    table_users: int | None = None
    mismatches: list[str] = field(default_factory=list)
    states: dict[str, UserLedger] = field(default_factory=dict, repr=False)  # rebuilt from the ledger

    @property
    def ok(self) -> bool:
        return not self.violations and not self.mismatches and not self.undecodable

    def render(self) -> str:
        lines = [
            f"ledger entries read: {self.entries_read}",
            f"events read: {self.events_read} (duplicates skipped: {self.duplicate_events})",
            f"undecodable entries: {len(self.undecodable)}",
            f"users: {self.users}",
            "generations by terminal state: "
            + (", ".join(f"{k}={v}" for k, v in sorted(self.terminal.items())) or "none"),
            f"messages consumed: {self.consumed}, released: {self.released}",
            f"submits refused as read after their decision deadline: {self.refused_late}",
            f"token reservations: {self.token_reservations}, settled: {self.token_settlements}, "
            f"still held: {self.tokens_unsettled}; tokens charged: {self.tokens_billable} "
            f"(overshoot {self.tokens_overshoot})",
        ]
        if self.table_users is not None:
            lines.append(f"table users compared: {self.table_users}, mismatches: {len(self.mismatches)}")
        lines.append(f"violations: {len(self.violations)}")
        lines.extend(f"  {v}" for v in self.violations)
        lines.extend(f"  undecodable {u}" for u in self.undecodable)
        lines.extend(f"  mismatch {m}" for m in self.mismatches)
        lines.append("AUDIT OK" if self.ok else "AUDIT FAILED")
        return "\n".join(lines)


class Auditor:
    """Folds ledger entries one at a time; usable on a live topic or on a list of entries."""

    def __init__(self, concurrency_limit: int | None = None, dedup_retention_ms: int | None = None) -> None:
        # With the retention, a request record forgotten before it ended is a violation (invariant 7).
        # The check uses today's setting: a ledger written under a shorter one reports those purges.
        self.monitor = InvariantMonitor(concurrency_limit=concurrency_limit, dedup_retention_ms=dedup_retention_ms)
        self.report = AuditReport()

    def feed(self, entry: ev.LedgerEntry) -> None:
        self.report.entries_read += 1
        before = self.monitor.duplicates_skipped
        self.report.violations.extend(self.monitor.observe_batch(entry.events))
        self.report.events_read += len(entry.events)
        self.report.duplicate_events += self.monitor.duplicates_skipped - before
        if self.monitor.duplicates_skipped - before == len(entry.events):
            return  # a redelivered entry: already counted
        for e in entry.events:
            if isinstance(e, ev.ReservationConsumed):
                self.report.consumed += 1
            elif isinstance(e, ev.ReservationReleased):
                self.report.released += 1
            elif isinstance(e, ev.TERMINAL_EVENT_TYPES):
                self.report.terminal[type(e).__name__.removeprefix("Generation").lower()] += 1
            elif isinstance(e, ev.AdmissionRejected) and e.decide_by_ms and e.read_at_ms > e.decide_by_ms:
                self.report.refused_late += 1
            if isinstance(e, ev.GenerationAdmitted) and e.tokens_reserved:
                self.report.token_reservations += 1
            elif isinstance(e, ev.ReservationReleased) and e.tokens_released:
                self.report.token_settlements += 1
            elif isinstance(e, ev.UsageRecorded):
                self.report.token_settlements += 1 if e.tokens_reserved else 0
                self.report.tokens_billable += billable_of(e)
                self.report.tokens_overshoot += e.overshoot_tokens

    def feed_raw(self, where: str, value: bytes | None) -> None:
        try:
            self.feed(decode_ledger_entry(value or b""))
        except WireError as exc:
            self.report.undecodable.append(f"{where}: {exc.reason}")

    def finish(self, table: dict[str, UserLedger] | None = None) -> AuditReport:
        self.report.users = len(self.monitor.states)
        self.report.states = self.monitor.states
        self.report.tokens_unsettled = len(self.monitor.unsettled_token_reservations())
        if table is not None:
            self.report.table_users = len(table)
            for user_id, rebuilt in self.monitor.states.items():
                held = table.get(user_id)
                if held is None:
                    self.report.mismatches.append(f"user {user_id}: in the ledger, not in the table")
                elif held != rebuilt:
                    self.report.mismatches.append(
                        f"user {user_id}: table state differs from the replayed ledger: {state_difference(held, rebuilt)}"
                    )
            for user_id, held in table.items():
                if user_id not in self.monitor.states and held.requests:
                    self.report.mismatches.append(f"user {user_id}: in the table, not in the ledger")
                self.report.violations.extend(check_state(held, self.monitor.concurrency_limit))
        return self.report


async def read_table(bootstrap: str, topology: Topology) -> dict[str, UserLedger]:
    """The processor's table: the latest changelog value per user."""
    latest: dict[bytes, bytes | None] = {}
    for _, _, key, value in sorted(await read_topic(bootstrap, topology.changelog), key=lambda r: (r[0], r[1])):
        if key is not None:
            latest[key] = value
    return join_table(latest.items(), Policy())


async def audit(
    bootstrap: str,
    topology: Topology,
    start: dict[int, int] | None = None,
    from_time_ms: int | None = None,
    compare_table: bool = True,
    concurrency_limit: int | None = None,
    dedup_retention_ms: int | None = None,
) -> AuditReport:
    auditor = Auditor(concurrency_limit, dedup_retention_ms)
    records = await read_topic(bootstrap, topology.ledger, start, from_time_ms)
    # Per user, order is the partition's order; partitions are independent.
    for partition, offset, _, value in sorted(records, key=lambda r: (r[0], r[1])):
        auditor.feed_raw(f"{topology.ledger.name}[{partition}]@{offset}", value)
    table = await read_table(bootstrap, topology) if compare_table and start is None and from_time_ms is None else None
    return auditor.finish(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m projections.ledger.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default=kafka_bootstrap())
    parser.add_argument("--namespace", default=env_value("CHATPLANE_NAMESPACE", ""))
    parser.add_argument("--from-offset", type=int, help="start every partition at this offset")
    parser.add_argument("--from-time", help="start at this ISO-8601 time (UTC)")
    parser.add_argument("--no-table", action="store_true", help="do not compare with the processor's table")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    topology = Topology(args.namespace)
    start = {p: args.from_offset for p in range(topology.ledger.partitions)} if args.from_offset is not None else None
    from_time_ms = int(datetime.fromisoformat(args.from_time).timestamp() * 1000) if args.from_time else None
    retention_ms = env_value("CHATPLANE_DEDUP_RETENTION_MS", Policy().dedup_retention_ms, ge=0)
    report = asyncio.run(
        audit(args.bootstrap, topology, start, from_time_ms, compare_table=not args.no_table, dedup_retention_ms=retention_ms)
    )
    if args.json:
        doc: dict[str, Any] = {
            "entries_read": report.entries_read,
            "events_read": report.events_read,
            "users": report.users,
            "terminal": dict(report.terminal),
            "consumed": report.consumed,
            "released": report.released,
            "refused_late": report.refused_late,
            "token_reservations": report.token_reservations,
            "token_settlements": report.token_settlements,
            "tokens_unsettled": report.tokens_unsettled,
            "tokens_billable": report.tokens_billable,
            "tokens_overshoot": report.tokens_overshoot,
            "violations": [str(v) for v in report.violations],
            "mismatches": report.mismatches,
            "undecodable": report.undecodable,
            "ok": report.ok,
        }
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())


DIFFERENCE_ITEMS_MAX = 5  # differing keys named per field of a mismatch


def state_difference(table: UserLedger, replayed: UserLedger) -> str:
    """Which fields (and for maps which keys) of a user's state differ: table value vs the replay."""
    parts: list[str] = []
    for name in UserLedger.__dataclass_fields__:
        a, b = getattr(table, name), getattr(replayed, name)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted((k for k in a.keys() | b.keys() if a.get(k) != b.get(k)), key=str)
            shown = [f"{k}: table={a.get(k)!r} replay={b.get(k)!r}" for k in keys[:DIFFERENCE_ITEMS_MAX]]
            parts.append(f"{name} ({len(keys)} keys) " + "; ".join(shown))
        else:
            parts.append(f"{name}: table={a!r} replay={b!r}")
    return " | ".join(parts)[:4000]
