"""Settings of the SLO report (``python -m projections.reports.slo``), read from the environment once."""

from __future__ import annotations

from dataclasses import dataclass

from infra.runtime.settings import kafka_bootstrap_setting, setting
from schemas.topics import Topology


@dataclass(frozen=True)
class SloSettings:
    kafka_bootstrap: str = kafka_bootstrap_setting()
    topology: Topology = setting("CHATPLANE_NAMESPACE", Topology(""), parse=Topology, expected="a namespace")
    # Most records read from each topic (outcomes, ledger; a batch of outcomes counts as the outcomes it
    # holds); past it the report stops reading and says it is truncated rather than hold an unbounded
    # window in memory.
    records_max: int = setting("CHATPLANE_SLO_RECORDS_MAX", 2_000_000, ge=1)
    # How far past --to the topics are read: the outcome of a request that arrived before --to is
    # written when its response ends, and a generation accepted before --to ends later.
    settle_s: float = setting("CHATPLANE_SLO_SETTLE_S", 600.0, ge=0)
    # The whole read of one topic gives up after this long.
    read_timeout_s: float = setting("CHATPLANE_SLO_READ_TIMEOUT_S", 300.0, gt=0)
