"""The SLO report's command line (docs/slo.md).

    python -m projections.reports.slo --from 2026-12-06T02:00:00Z --to 2026-12-06T03:00:00Z [--json]
        [--chart out.png] [--bucket 5m] [--dump records.jsonl]
    python -m projections.reports.slo --file records.jsonl [--from ...] [--to ...] [--json]

Reads the outcomes topic (``EdgeOutcomeBatch``, or one ``EdgeOutcome`` in older records) and the ledger
topic (``LedgerEntry``) between the times (``projections.reports.slo.read``; not logs), or a recorded dump
of them (``--file``, one JSON record per line, as ``--dump`` writes it), and prints the four objectives
(``projections.reports.slo.compute``) as a table or JSON, overall and per bucket. Exit status 0 with a report, 2 for a bad argument or setting.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import re
import sys
from pathlib import Path
from typing import Any

import orjson

from infra.runtime.settings import SettingsError, exit_on_settings_error
from projections.reports.slo.chart import write_chart
from projections.reports.slo.compute import DECISION_MS_MAX, Objectives, Report, compute
from projections.reports.slo.read import Records, read_file, read_topics
from projections.reports.slo.settings import SloSettings

_BUCKET = re.compile(r"^(\d+)([smhd])$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time(text: str) -> int:
    """ISO 8601 (``Z`` or an offset; none means UTC) or ``now``, as epoch milliseconds."""
    if text == "now":
        return int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


def parse_bucket(text: str) -> int:
    """``30s``, ``5m``, ``1h``, ``1d`` as milliseconds."""
    match = _BUCKET.match(text)
    if match is None or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"not a bucket length like 30s, 5m, 1h: {text!r}")
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


def iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _pct(value: float | None) -> str:
    return "no data" if value is None else f"{value * 100:.3f}%"


def _status(met: bool | None) -> str:
    return "no data" if met is None else ("met" if met else "MISSED")


def _rows(o: Objectives) -> list[tuple[str, str, str, str, str]]:
    ttft = o.ttft
    sources = ", ".join(f"{k} {v}" for k, v in sorted(ttft.sources.items())) or "none"
    return [
        ("admission response contract", f">= {o.contract.target * 100:g}% in {DECISION_MS_MAX:g} ms", _pct(o.contract.value),
         f"{o.contract.good}/{o.contract.total}", _status(o.contract.met)),
        ("eligible admission availability", f">= {o.availability.target * 100:g}%", _pct(o.availability.value),
         f"{o.availability.good}/{o.availability.total}", _status(o.availability.met)),
        ("time to first text token p95", f"< {ttft.target_ms:g} ms", "no data" if ttft.value is None else f"{ttft.value:.1f} ms",
         f"n={len(ttft.samples_ms)} ({sources})", _status(ttft.met)),
        ("accepted generation completion", f">= {o.completion.target * 100:g}%", _pct(o.completion.value),
         f"{o.completion.good}/{o.completion.total}", _status(o.completion.met)),
    ]


def render_table(report: Report, records: Records) -> str:
    lines = [
        f"SLO report {iso(report.start_ms)} .. {iso(report.end_ms)}  "
        f"(records: {report.outcome_records} edge outcomes, {report.ledger_entries} ledger entries"
        + (", TRUNCATED at the records limit" if records.truncated else "")
        + (f", {records.undecodable} undecodable skipped" if records.undecodable else "") + ")",
        "",
        f"{'objective':34} {'target':22} {'value':12} {'count':26} status",
    ]
    lines += [f"{a:34} {b:22} {c:12} {d:26} {e}" for a, b, c, d, e in _rows(report.overall)]
    o = report.overall
    for name, ratio in (("contract", o.contract), ("availability", o.availability), ("completion", o.completion)):
        if ratio.misses:
            lines.append(f"  {name} misses: " + ", ".join(f"{k} {v}" for k, v in sorted(ratio.misses.items())))
        if ratio.excluded:
            lines.append(f"  {name} excluded: " + ", ".join(f"{k} {v}" for k, v in sorted(ratio.excluded.items())))
    lines.append("  TTFT: edge = POST received -> first text delta forwarded (used when the edge recorded it); "
                 "worker = acceptance -> first token (UsageRecorded.ttft_ms)")
    if report.buckets:
        lines += ["", f"{'bucket start':22} {'contract':12} {'availability':14} {'ttft p95':12} {'completion':12}"]
        for start, b in report.buckets:
            ttft = "-" if b.ttft.value is None else f"{b.ttft.value:.1f} ms"
            lines.append(
                f"{iso(start):22} {_pct(b.contract.value) if b.contract.total else '-':12} "
                f"{_pct(b.availability.value) if b.availability.total else '-':14} {ttft:12} "
                f"{_pct(b.completion.value) if b.completion.total else '-':12}"
            )
    return "\n".join(line.rstrip() for line in lines)


def report_json(report: Report, records: Records, source: str) -> dict[str, Any]:
    doc = report.as_dict()
    doc["from"], doc["to"] = iso(report.start_ms), iso(report.end_ms)
    doc["source"] = source
    doc["truncated"] = records.truncated
    doc["undecodable"] = records.undecodable
    doc["ttft_definition"] = {
        "edge": "POST received -> first text delta forwarded (EdgeOutcome.ttft_ms); used when present",
        "worker": "acceptance -> first token (UsageRecorded.ttft_ms); used only without an edge record",
    }
    for b in doc["buckets"]:
        b["start"] = iso(b["start_ms"])
    return doc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m projections.reports.slo", description="The seed's four service objectives from the outcomes and ledger topics.")
    p.add_argument("--from", dest="start", type=parse_time, help="window start, ISO 8601 (required unless --file)")
    p.add_argument("--to", dest="end", type=parse_time, help="window end (exclusive), ISO 8601 or now (required unless --file)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--chart", type=Path, help="write a PNG chart of each objective per bucket against its target")
    p.add_argument("--bucket", type=parse_bucket, help="bucket length (30s, 5m, 1h, 1d); default: none (one row), 5m with --chart")
    p.add_argument("--file", type=Path, help="compute from a recorded dump (JSON lines) instead of Kafka")
    p.add_argument("--dump", type=Path, help="also write the records read from Kafka to this file (for --file)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = SloSettings()
    except SettingsError as exc:
        exit_on_settings_error(exc)
    if args.file is not None:
        try:
            records = read_file(args.file)
        except (OSError, ValueError) as exc:
            print(f"cannot read {args.file}: {exc}", file=sys.stderr)
            return 2
        times = [o.received_at_ms for o in records.outcomes] + [e.events[0].occurred_at_ms for e in records.entries if e.events]
        start = args.start if args.start is not None else min(times, default=0)
        end = args.end if args.end is not None else max(times, default=0) + 1
        source = f"file {args.file}"
    else:
        if args.start is None or args.end is None:
            print("--from and --to are required (or --file)", file=sys.stderr)
            return 2
        start, end = args.start, args.end
        until = end + int(settings.settle_s * 1000)
        topology = settings.topology
        records, raw = asyncio.run(
            read_topics(settings.kafka_bootstrap, topology.outcomes, topology.ledger, start, until, settings.records_max, settings.read_timeout_s)
        )
        source = f"kafka {settings.kafka_bootstrap} {topology.outcomes.name} + {topology.ledger.name}"
        if args.dump is not None:
            args.dump.write_bytes(b"".join(v.rstrip(b"\n") + b"\n" for v in raw))
    if end <= start:
        print("--to must be after --from", file=sys.stderr)
        return 2
    bucket_ms = args.bucket if args.bucket is not None else (5 * _UNIT_MS["m"] if args.chart else None)
    try:
        report = compute(records.outcomes, records.entries, start, end, bucket_ms)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(report_json(report, records, source), option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_table(report, records))
    if args.chart is not None:
        try:
            write_chart(report, args.chart)
        except RuntimeError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        print(f"chart written to {args.chart}", file=sys.stderr)
    return 0
