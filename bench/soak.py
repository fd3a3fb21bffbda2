"""The soak: the whole stack under a steady ``sim`` load for 30 minutes, the resident memory
of every process sampled each minute; does any process keep growing?

    .venv/bin/python bench/soak.py                 # 30 minutes, a sample a minute
    .venv/bin/python bench/soak.py --minutes 6 --sample-s 30 --from-minute 2   # a quick look

The stack is bench/stackrun.py's (its own broker and Cassandra on private ports; one processor, one
read model, one ``sim`` worker, one edge, as ``make up`` runs them; ``--processors`` etc. for more).
The load: ``--loops`` client loops over HTTP, each one request at a time with a short pause, over a
fixed population of ``--users`` paid-tier users (so per-user state reaches its steady size instead of
growing with new users): streams read to the end, non-streams, cancels after the first words, hang-ups
mid-stream, same-key retries. Request records are kept ``--dedup-retention-s`` (120 s here instead of
the contract's 24 h, so that the records held reach their steady number within the run: the soak
looks for memory that is never given back, not for what the contract keeps). For the same reason the
bounded caches that would take hours to fill at this rate (the edge's recent generations and result
cache, the read model's seen command ids) are set small (``SMALL_CACHES``; ``--no-small-caches`` keeps the defaults),
and each client keeps one token per user, as a real one does.

Printed per process: RSS at the first sample at or after ``--from-minute`` and at the end, the growth
between them, the least-squares slope over those samples (MiB per minute), CPU seconds; and the
requests by outcome. Target: no chatplane process grows by more than 5 % between minute 5 and the
end (the JVMs are listed too: their heaps grow up to -Xmx by design).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stackrun import Stack, cpu_seconds, rss_bytes  # noqa: E402
from schemas.codes import Tier  # noqa: E402
from infra.harness.load import SIM_ENV, Load  # noqa: E402

GROWTH_TARGET = 0.05
# Bounded caches that at the soak's rate would take hours to fill (and so grow through the whole run
# by design): set small so that they are full before the growth is judged, and what grows after is a
# leak. Their sizes at the default bounds are in docs/reliability.md.
SMALL_CACHES = {"CHATPLANE_EDGE_RECENT_GENERATIONS_MAX": 2_000, "CHATPLANE_READMODEL_SEEN_COMMANDS_MAX": 10_000,
                "CHATPLANE_EDGE_RESULT_CACHE_BYTES_MAX": 1024 * 1024}
MIB = 1024 * 1024
JVMS = ("kafka", "cassandra")


class SteadyLoad(Load):
    """The chaos run's client calls, over a fixed population of paid users, without faults."""

    def __init__(self, stack: Stack, seed: int, loops: int, users: int) -> None:
        super().__init__(stack, seed, loops, heavy_loops=0)
        self.users = [f"s{self.run_id}-{i}" for i in range(users)]
        self.tally: Counter[str] = Counter()  # outcomes of the calls already counted out of self.outcomes

    def headers(self, user: str, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(user, Tier.PAID)}", "Idempotency-Key": key}

    async def _loop(self, n: int) -> None:
        rng = random.Random(self.seed * 1_000 + n)
        while not self.stopping.is_set():
            user = rng.choice(self.users)
            key = uuid.uuid4().hex
            e = rng.randrange(len(self.http))
            r = rng.random()
            if r < 0.40:
                await self._stream(rng, "stream", user, key, e)
            elif r < 0.75:
                await self._nonstream(rng, "nonstream", user, key, e, self.body(rng, False))
            elif r < 0.85:
                await self._stream(rng, "cancel", user, key, e)
            elif r < 0.95:
                await self._stream(rng, "disconnect", user, key, e)
            else:
                body = self.body(rng, False)
                await asyncio.gather(self._nonstream(rng, "retry_a", user, key, e, body),
                                     self._nonstream(rng, "retry_b", user, key, (e + 1) % len(self.http), body, delay_s=0.3))
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            if len(self.outcomes) > 1_000:  # keep only the tallies: the driver's memory is not measured, but bounded
                self.tally.update(f"{o.kind}:{o.status or o.ending}:{o.code or '-'}" for o in self.outcomes)
                self.outcomes.clear()


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minute, MiB) points."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


async def soak(args: argparse.Namespace, work: Path) -> int:
    stack = Stack(work, namespace=f"soak{uuid.uuid4().hex[:6]}", processors=args.processors, workers=args.workers,
                  edges=args.edges, readmodels=1,
                  env={**SIM_ENV, "CHATPLANE_DEDUP_RETENTION_MS": int(args.dedup_retention_s * 1000),
                       **(SMALL_CACHES if args.small_caches else {}), **dict(item.split("=", 1) for item in args.env)})
    await stack.start()
    load = SteadyLoad(stack, args.seed, args.loops, args.users)
    samples: dict[str, list[tuple[float, int]]] = {}
    cpu0 = {name: cpu_seconds(pid) or 0.0 for name, pid in stack.pids().items()}
    pids0 = stack.pids()
    t0 = time.monotonic()
    task = asyncio.create_task(load.run())
    try:
        while (elapsed := time.monotonic() - t0) < args.minutes * 60:
            for name, pid in stack.pids().items():
                if pids0.get(name) != pid:
                    print(f"[soak] {name} restarted: its samples stop", flush=True)
                    continue
                rss = rss_bytes(pid)
                if rss is not None:
                    samples.setdefault(name, []).append((elapsed / 60, rss))
            line = ", ".join(f"{n} {s[-1][1] / MIB:.0f}" for n, s in sorted(samples.items()))
            print(f"[soak] {elapsed / 60:5.1f} min, {len(load.outcomes) + sum(load.tally.values())} calls; RSS MiB: {line}", flush=True)
            await asyncio.sleep(min(args.sample_s, max(0.0, args.minutes * 60 - elapsed)) or 0.01)
        for name, pid in stack.pids().items():  # the last sample, at the end
            rss = rss_bytes(pid)
            if rss is not None and pids0.get(name) == pid:
                samples.setdefault(name, []).append(((time.monotonic() - t0) / 60, rss))
    finally:
        load.stopping.set()
        await task
        cpu = {name: (cpu_seconds(pid) or 0.0) - cpu0.get(name, 0.0) for name, pid in stack.pids().items()}
        await load.close()
        stack.stop()
    load.tally.update(f"{o.kind}:{o.status or o.ending}:{o.code or '-'}" for o in load.outcomes)
    calls = sum(load.tally.values())
    print(f"\nsoak: {args.minutes} min, {args.loops} loops, {args.users} users, {calls} calls "
          f"({calls / (args.minutes * 60):.1f}/s); by outcome: {dict(load.tally.most_common())}")
    print(f"RSS from the first sample at or after minute {args.from_minute} to the end (target: growth <= {GROWTH_TARGET:.0%} "
          "for chatplane processes)")
    print(f"{'process':<14}{'start MiB':>10}{'end MiB':>10}{'growth':>9}{'slope MiB/min':>15}{'CPU s':>9}  verdict")
    missed = 0
    for name in sorted(samples):
        window = [(m, r / MIB) for m, r in samples[name] if m >= args.from_minute]
        if len(window) < 2:
            print(f"{name:<14} too few samples after minute {args.from_minute}")
            continue
        first, last = window[0][1], window[-1][1]
        growth = (last - first) / first
        if name.split("-")[0] in JVMS or name in JVMS:
            verdict = "JVM (heap grows to -Xmx; not judged)"
        elif growth <= GROWTH_TARGET:
            verdict = "met"
        else:
            verdict = "MISSED"
            missed += 1
        print(f"{name:<14}{first:>10.1f}{last:>10.1f}{growth:>9.1%}{slope(window):>15.3f}{cpu.get(name, 0.0):>9.1f}  {verdict}")
    print(f"logs in {stack.log_dir}")
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=60.0)
    p.add_argument("--from-minute", type=float, default=5.0, help="growth is judged from the first sample at or after it")
    p.add_argument("--loops", type=int, default=10)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--dedup-retention-s", type=float, default=120.0)
    p.add_argument("--processors", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--edges", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--small-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="bounded caches set small so that they fill before the growth is judged (default on)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a setting for every component")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="chatplane-soak-"))
    return asyncio.run(soak(args, work))


if __name__ == "__main__":
    sys.exit(main())
