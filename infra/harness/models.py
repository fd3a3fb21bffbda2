"""The tests' model catalog (tests/fixtures/catalog.toml: the default catalog's model plus the
simulator) and the names the tests and the benchmarks use from it.

The catalog is a data file read by path (``CHATPLANE_MODEL_CATALOG``): nothing here imports ``tests``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_CATALOG_PATH = ROOT / "tests" / "fixtures" / "catalog.toml"
CPU_ALIAS = "fast-text-model"  # the real model (SmolLM2 on llama.cpp), as in the default catalog
SIM_ALIAS = "simulated-text-model"  # the simulator: only a sim worker serves it
SIM_POOL = "simulated"
