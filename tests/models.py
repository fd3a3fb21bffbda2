"""The tests' model catalog (tests/fixtures/catalog.toml) and the names tests use from it."""

from __future__ import annotations

from pathlib import Path

TEST_CATALOG_PATH = Path(__file__).resolve().parent / "fixtures" / "catalog.toml"
CPU_ALIAS = "fast-text-model"  # the real model (SmolLM2 on llama.cpp), as in the default catalog
SIM_ALIAS = "simulated-text-model"  # the simulator: only a sim worker serves it
SIM_POOL = "simulated"
