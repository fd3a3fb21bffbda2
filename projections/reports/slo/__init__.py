"""The SLO report: the seed's four service objectives from the outcomes and ledger topics (docs/slo.md).

``compute`` (pure, over recorded records), ``read`` (bounded Kafka reads by time), ``report`` (the
command line: ``python -m projections.reports.slo``), ``chart`` (matplotlib, the ``analytics`` extra).
"""
