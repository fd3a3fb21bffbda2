"""docs/retention.md states the retention settings the code applies (schemas/topics.py, the result
store's and the metadata's TTLs); change one and this fails until the doc says the same."""

from __future__ import annotations

from pathlib import Path

from infra.stores.schema import GENERATION_METADATA_TTL_S_DEFAULT, RESULT_TTL_S_DEFAULT
from schemas.tables import results_ddl
from infra.models.catalog import DEFAULT_CATALOG_PATH, load_catalog
from infra.runtime.kafka_admin import deployment_topics
from schemas.topics import Topology

DOC = Path(__file__).resolve().parents[2] / "docs" / "retention.md"


def topic_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`chatplane"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_every_topic_is_in_the_doc_with_its_exact_configs():
    rows = topic_rows()
    specs = deployment_topics(Topology(), load_catalog(DEFAULT_CATALOG_PATH))  # the default deployment's
    for spec in specs:
        want = ", ".join(f"{k}={v}" for k, v in spec.configs().items())
        assert rows.get(spec.name) == want, f"docs/retention.md row of {spec.name}: {rows.get(spec.name)!r} != {want!r}"
    assert set(rows) == {s.name for s in specs}, "the doc lists a topic the code does not have"


def test_the_doc_states_the_cassandra_ttls():
    text = DOC.read_text(encoding="utf-8")
    assert f"default {RESULT_TTL_S_DEFAULT}," in text
    assert f"default {GENERATION_METADATA_TTL_S_DEFAULT} " in text
    assert "gc_grace_seconds = 3600" in results_ddl("ks") and "gc_grace_seconds = 3600" in text
