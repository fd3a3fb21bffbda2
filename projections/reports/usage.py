"""The analysts' usage report: totals per user, model and hour from the USAGE topic, and a PNG chart.

    python -m projections.reports.usage --from 2026-11-06T15:00:00Z --to 2026-11-06T18:00:00Z \\
        [--namespace NS] [--bootstrap HOST:PORT] [--chart usage.png | --no-chart] [--json]

Data flow::

    admission processor --USAGE (key user_id; one UsageRecorded per (generation, epoch))--> here
        --> totals per user / model version / hour (stdout) and tokens + generations per hour (PNG)

The topic carries the ledger's ``UsageRecorded`` events as JSON (schema: ``docs/schemas/usage.json``,
described in docs/readmodels.md). A record belongs to the range by its ``occurred_at_ms`` (when the
processor recorded the usage), half-open ``[from, to)``. The topic is at-least-once (a processor
that crashed before its commit re-sends), so records are de-duplicated by ``(generation_id,
epoch)``: the core records usage at most once per attempt (invariant 8), so a second record with
that key is a re-send. Undecodable records are counted and reported, never silently dropped.

Reading is bounded: the consumer seeks by Kafka timestamp to ``from - USAGE_SEEK_SLACK_MS`` (a
record is produced after the usage it reports) and stops at the end offsets taken at start.
matplotlib is only needed for the chart (``pip install chatplane[analytics]``); without it the
report still prints, and asking for a chart fails with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import orjson

from infra.runtime.settings import env_value, kafka_bootstrap
from infra.runtime.topic_reader import read_topic
from schemas import events as ev
from schemas.topics import HOUR_MS, Topology
from schemas.wire import WireError, decode_event

USAGE_SEEK_SLACK_MS = HOUR_MS  # records are produced after the usage they report; seek this far back
CHART_WIDTH_IN = 10.0
CHART_HEIGHT_IN = 6.0
CHART_DPI = 100


@dataclass(frozen=True, slots=True)
class UsageTotals:
    generations: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def plus(self, r: ev.UsageRecorded) -> UsageTotals:
        return UsageTotals(self.generations + 1, self.input_tokens + r.input_tokens, self.output_tokens + r.output_tokens)

    def as_dict(self) -> dict[str, int]:
        return {"generations": self.generations, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens}


@dataclass
class UsageReport:
    from_ms: int
    to_ms: int
    total: UsageTotals = UsageTotals()
    by_user: dict[str, UsageTotals] = field(default_factory=dict)
    by_model: dict[str, UsageTotals] = field(default_factory=dict)
    by_hour: dict[int, UsageTotals] = field(default_factory=dict)  # hour start (ms, UTC) -> totals
    by_user_model_hour: dict[tuple[str, str, int], UsageTotals] = field(default_factory=dict)
    duplicates_skipped: int = 0
    undecodable: int = 0
    records_read: int = 0

    def as_json(self) -> dict:
        return {
            "from_ms": self.from_ms,
            "to_ms": self.to_ms,
            "total": self.total.as_dict(),
            "by_user": {k: v.as_dict() for k, v in sorted(self.by_user.items())},
            "by_model": {k: v.as_dict() for k, v in sorted(self.by_model.items())},
            "by_hour": {_iso(k): v.as_dict() for k, v in sorted(self.by_hour.items())},
            "by_user_model_hour": [
                {"user_id": u, "model_version": m, "hour": _iso(h), **v.as_dict()}
                for (u, m, h), v in sorted(self.by_user_model_hour.items())
            ],
            "duplicates_skipped": self.duplicates_skipped,
            "undecodable": self.undecodable,
            "records_read": self.records_read,
        }


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time_ms(text: str) -> int:
    """``2026-11-06T15:00:00Z`` (any ISO 8601 with a zone; naive means UTC) or epoch milliseconds."""
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"not an ISO 8601 time or epoch ms: {text!r}") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def aggregate_usage(records: Iterable[ev.UsageRecorded], from_ms: int, to_ms: int) -> UsageReport:
    """Totals of the records with ``from_ms <= occurred_at_ms < to_ms``, one per (generation, epoch)."""
    report = UsageReport(from_ms, to_ms)
    seen: set[tuple[str, int]] = set()
    by_user: dict[str, UsageTotals] = defaultdict(UsageTotals)
    by_model: dict[str, UsageTotals] = defaultdict(UsageTotals)
    by_hour: dict[int, UsageTotals] = defaultdict(UsageTotals)
    by_umh: dict[tuple[str, str, int], UsageTotals] = defaultdict(UsageTotals)
    for r in records:
        if not from_ms <= r.occurred_at_ms < to_ms:
            continue
        key = (r.generation_id, r.epoch)
        if key in seen:
            report.duplicates_skipped += 1
            continue
        seen.add(key)
        hour = r.occurred_at_ms - r.occurred_at_ms % HOUR_MS
        report.total = report.total.plus(r)
        by_user[r.user_id] = by_user[r.user_id].plus(r)
        by_model[r.model_version] = by_model[r.model_version].plus(r)
        by_hour[hour] = by_hour[hour].plus(r)
        by_umh[(r.user_id, r.model_version, hour)] = by_umh[(r.user_id, r.model_version, hour)].plus(r)
    report.by_user, report.by_model, report.by_hour, report.by_user_model_hour = (
        dict(by_user), dict(by_model), dict(by_hour), dict(by_umh)
    )
    return report


async def read_usage(bootstrap: str, topology: Topology, from_ms: int, to_ms: int) -> UsageReport:
    """Read the topic for the range (end offsets fixed at start) and aggregate it."""
    raw = await read_topic(bootstrap, topology.usage, from_time_ms=max(0, from_ms - USAGE_SEEK_SLACK_MS))
    decoded: list[ev.UsageRecorded] = []
    undecodable = 0
    for _partition, _offset, _key, value in raw:
        try:
            e = decode_event(value or b"")
        except WireError:
            undecodable += 1
            continue
        if isinstance(e, ev.UsageRecorded):
            decoded.append(e)
        else:
            undecodable += 1
    report = aggregate_usage(decoded, from_ms, to_ms)
    report.undecodable = undecodable
    report.records_read = len(raw)
    return report


def render_text(report: UsageReport) -> str:
    lines = [f"usage {_iso(report.from_ms)} .. {_iso(report.to_ms)} (half-open)"]
    t = report.total
    lines.append(f"total: {t.generations} generations, {t.input_tokens} input tokens, {t.output_tokens} output tokens")

    def table(title: str, items: list[tuple[str, UsageTotals]]) -> None:
        lines.append("")
        lines.append(f"{title:<40} {'generations':>12} {'input_tokens':>13} {'output_tokens':>14}")
        for name, v in items:
            lines.append(f"{name:<40} {v.generations:>12} {v.input_tokens:>13} {v.output_tokens:>14}")

    table("user", sorted(report.by_user.items()))
    table("model_version", sorted(report.by_model.items()))
    table("hour (UTC)", [(_iso(h), v) for h, v in sorted(report.by_hour.items())])
    table(
        "user / model_version / hour",
        [(f"{u} / {m} / {_iso(h)}", v) for (u, m, h), v in sorted(report.by_user_model_hour.items())],
    )
    lines.append("")
    lines.append(
        f"records read {report.records_read}, duplicates skipped {report.duplicates_skipped}, "
        f"undecodable {report.undecodable}"
    )
    return "\n".join(lines)


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed (it is the optional ``analytics`` extra)."""


def write_chart(report: UsageReport, path: str) -> None:
    """Tokens (input, output) and generations per hour over the range, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ChartUnavailable("the chart needs matplotlib: pip install 'chatplane[analytics]'") from exc
    hours = list(range(report.from_ms - report.from_ms % HOUR_MS, report.to_ms, HOUR_MS))
    xs = [datetime.fromtimestamp(h / 1000, UTC) for h in hours]
    zero = UsageTotals()
    fig, (ax_tok, ax_gen) = plt.subplots(2, 1, figsize=(CHART_WIDTH_IN, CHART_HEIGHT_IN), sharex=True)
    ax_tok.plot(xs, [report.by_hour.get(h, zero).input_tokens for h in hours], marker="o", label="input tokens")
    ax_tok.plot(xs, [report.by_hour.get(h, zero).output_tokens for h in hours], marker="o", label="output tokens")
    ax_tok.set_ylabel("tokens / hour")
    ax_tok.legend()
    ax_tok.set_title(f"chatplane usage {_iso(report.from_ms)} .. {_iso(report.to_ms)}")
    ax_gen.bar(xs, [report.by_hour.get(h, zero).generations for h in hours], width=1 / 30, label="generations")
    ax_gen.set_ylabel("generations / hour")
    ax_gen.set_xlabel("hour (UTC)")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=CHART_DPI, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m projections.reports.usage", description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="from_", required=True, help="ISO 8601 time or epoch ms (inclusive)")
    parser.add_argument("--to", required=True, help="ISO 8601 time or epoch ms (exclusive)")
    parser.add_argument("--bootstrap", default=kafka_bootstrap())
    parser.add_argument("--namespace", default=env_value("CHATPLANE_NAMESPACE", ""))
    parser.add_argument("--chart", default="usage-report.png", help="PNG path (default usage-report.png)")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the totals as JSON instead of tables")
    args = parser.parse_args(argv)
    try:
        from_ms, to_ms = parse_time_ms(args.from_), parse_time_ms(args.to)
    except ValueError as exc:
        print(f"usage_report: {exc}", file=sys.stderr)
        return 2
    if to_ms <= from_ms:
        print("usage_report: --to must be after --from", file=sys.stderr)
        return 2
    report = asyncio.run(read_usage(args.bootstrap, Topology(args.namespace), from_ms, to_ms))
    print(orjson.dumps(report.as_json(), option=orjson.OPT_INDENT_2).decode() if args.json else render_text(report))
    if not args.no_chart:
        try:
            write_chart(report, args.chart)
        except ChartUnavailable as exc:
            print(f"usage_report: {exc}", file=sys.stderr)
            return 3
        print(f"chart written to {args.chart}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
