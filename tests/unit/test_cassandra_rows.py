"""``infra.stores.cassandra.named_tuple_rows``: the driver's default rows, with the row class built
once per column list instead of once per result set."""

from __future__ import annotations

import pytest
from cassandra.query import named_tuple_factory

from infra.stores.cassandra import named_tuple_rows


@pytest.mark.parametrize(
    "colnames",
    [["generation_id", "status", "output_tokens"], ["a b", "1x", "count(*)", "in"], ["x", "x"], []],
)
def test_rows_equal_the_drivers_named_tuples(colnames):
    rows = [tuple(range(len(colnames))), tuple(range(10, 10 + len(colnames)))]
    ours, theirs = named_tuple_rows(colnames, rows), named_tuple_factory(colnames, rows)
    assert [r._fields for r in ours] == [r._fields for r in theirs]
    assert [tuple(r) for r in ours] == [tuple(r) for r in theirs] == rows


def test_the_row_class_is_built_once_per_column_list():
    first = named_tuple_rows(["generation_id", "status"], [("g", "completed")])[0]
    second = named_tuple_rows(["generation_id", "status"], [("h", "failed")])[0]
    assert type(first) is type(second) and second.status == "failed"
    assert type(named_tuple_rows(["generation_id", "epoch"], [("g", 1)])[0]) is not type(first)
