"""``python -m control_plane.simulator``: run seeded simulations and print what they did.

The command line lives here so that the simulation itself (``control_plane.simulator``) stays a
pure module of the core: no argparse, no printing, no wall clock.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from control_plane.simulator import T0_MS, SimConfig, SimulationFailed, simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m control_plane.simulator", description="Seeded deterministic simulation of the edge, the admission processor, its timer and the workers.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=1, help="run this many consecutive seeds from --seed")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="override a SimConfig number, e.g. net_drop_p=0.2"
    )
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in SimConfig.__dataclass_fields__:
            parser.error(f"unknown SimConfig field {name!r}")
        overrides[name] = float(value) if "." in value or "e" in value else int(value)
    config = SimConfig(**overrides)
    for seed in range(args.seed, args.seed + args.seeds):
        started = time.perf_counter()
        try:
            sim = simulate(seed, args.steps, config)
        except SimulationFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        elapsed = time.perf_counter() - started
        s, summary = sim.stats, sim.summary()
        print(
            f"seed={seed} steps={s.steps} ({s.steps / elapsed:,.0f} steps/s, {elapsed:.1f} s) "
            f"simulated={(sim.now_ms - T0_MS) / 1000:,.0f} s  events={summary['events']} admitted={summary['admitted']}"
        )
        print(f"  generations by terminal status: {summary['terminal']}")
        print(
            f"  messages consumed={summary['messages_consumed']} released={summary['messages_released']}  "
            f"commands appended={s.commands_appended} consumed={s.commands_consumed} "
            f"answered-from-memory={s.commands_redelivered} lost={s.commands_lost}"
        )
        print(
            f"  network sent={s.messages_sent} dropped={s.messages_dropped} duplicated={s.messages_duplicated}  "
            f"crashes processor={s.processor_crashes} worker={s.worker_crashes}  pauses={s.pauses}  "
            f"inferences started={s.inferences_started}  edge timeouts={s.edge_timeouts}  "
            f"submits read after their deadline={s.submits_read_late}  "
            f"readers detached={s.detaches} reattached={s.attaches}"
        )
        print(f"  outcomes: {dict(s.outcomes)}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
