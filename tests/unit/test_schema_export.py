"""The committed JSON Schemas in docs/schemas/ are what ``python -m schemas.export`` writes today."""

from __future__ import annotations

import json
from pathlib import Path

from schemas import export
from schemas.commands import COMMAND_TYPES
from schemas.events import EVENT_TYPES
from schemas.messages import MESSAGE_TYPES


def test_the_committed_schema_files_are_up_to_date() -> None:
    assert export.stale() == [], "docs/schemas/ is out of date: run .venv/bin/python -m schemas.export"


def test_every_wire_type_appears_in_its_schema_file() -> None:
    for name, types in (("commands.json", COMMAND_TYPES), ("ledger_events.json", EVENT_TYPES), ("messages.json", MESSAGE_TYPES)):
        schema = json.loads((export.DEFAULT_DIR / name).read_text(encoding="utf-8"))
        assert {t.__name__ for t in types} <= set(schema["$defs"]), name


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    export.write(tmp_path)
    assert export.main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "commands.json").write_text("{}\n", encoding="utf-8")
    assert export.stale(tmp_path) == ["commands.json"]
    assert export.main(["--check", "--dir", str(tmp_path)]) == 1


def test_usage_schema_has_the_fields_analysts_need() -> None:
    schema = json.loads((export.DEFAULT_DIR / "usage.json").read_text(encoding="utf-8"))
    needed = {"generation_id", "epoch", "user_id", "input_tokens", "output_tokens", "terminal_reason",
              "model_version", "tier", "window_start_ms", "occurred_at_ms"}
    assert needed <= set(schema["properties"])
    assert needed <= set(schema["required"]) | {"type"}
    assert schema["properties"]["type"]["const"] == "UsageRecorded"


def test_outcomes_schema_describes_the_batch_record_and_the_old_one_record_form() -> None:
    schema = json.loads((export.DEFAULT_DIR / "outcomes.json").read_text(encoding="utf-8"))
    assert {"EdgeOutcomeBatch", "EdgeOutcome"} <= set(schema["$defs"])
    assert set(schema["discriminator"]["mapping"]) == {"EdgeOutcomeBatch", "EdgeOutcome"}
    batch = schema["$defs"]["EdgeOutcomeBatch"]
    assert batch["properties"]["outcomes"]["items"] == {"$ref": "#/$defs/EdgeOutcome"}
