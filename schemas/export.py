"""Write the JSON Schema of every wire type into ``docs/schemas/``, for readers in other languages.

    python -m schemas.export            # (re)write docs/schemas/*.json
    python -m schemas.export --check    # exit 1 if a committed file is missing or out of date

One file per family returned by ``schemas.wire.json_schemas()``: ``commands.json``,
``ledger_events.json``, ``messages.json`` and ``ledger_entry.json``; and ``usage.json``, the record
on the USAGE topic for analysts (a ``UsageRecorded`` event, exactly as the ledger carries it; see
docs/readmodels.md); and ``outcomes.json``, the record on the OUTCOMES topic (``EdgeOutcome``, one
per admission request, read by the SLO report: docs/slo.md). The files are generated; edit the dataclasses in ``schemas/`` and re-run this
instead of editing them by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import TypeAdapter

from schemas.events import UsageRecorded
from schemas.outcomes import outcome_json_schema
from schemas.wire import json_schemas

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "schemas"


def usage_schema() -> dict:
    """The USAGE topic's record (key: user_id; value: one ``UsageRecorded`` per (generation, epoch))."""
    schema = TypeAdapter(UsageRecorded).json_schema()
    schema["description"] = (
        "One record per (generation_id, epoch) on the chatplane.usage topic (key: user_id), the same "
        "UsageRecorded event the ledger holds; readers de-duplicate by (generation_id, epoch). "
        "The quota window is window_start_ms (its length is the policy's window). "
        + (schema.get("description") or "")
    ).strip()
    return schema


def rendered() -> dict[str, str]:
    """File name -> the exact text to commit (sorted keys, two-space indent, trailing newline)."""
    families = {**json_schemas(), "usage": usage_schema(), "outcomes": outcome_json_schema()}
    return {
        f"{family}.json": json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        for family, schema in families.items()
    }


def stale(directory: Path = DEFAULT_DIR) -> list[str]:
    """Names of the files that are missing or differ from what ``rendered()`` would write."""
    return [
        name
        for name, text in rendered().items()
        if not (directory / name).is_file() or (directory / name).read_text(encoding="utf-8") != text
    ]


def write(directory: Path = DEFAULT_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schemas.export", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale(args.dir)
        for name in out_of_date:
            print(f"{args.dir / name} is out of date: run python -m schemas.export", file=sys.stderr)
        return 1 if out_of_date else 0
    for path in write(args.dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
