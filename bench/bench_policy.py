"""Benchmark of the worker's output check per engine chunk (``infra.content.policy_checks``).

A script, not a test. The worker runs ``check_output`` on every engine chunk when a blocklist is
configured and, since the hold-back window, ``output_hold`` on the allowed text's tail as well. The
baseline, in the same run, is the check alone (what the worker did before the hold-back window); both
over the same random terms and the same chunks (one word per chunk, as the engines stream tokens).

    .venv/bin/python bench/bench_policy.py [--terms 10000] [--chunks 20000] [--rounds 5]

Prints microseconds per chunk for each, the best of the rounds (alternated) and their median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.content.policy_checks import Blocklist  # noqa: E402


def run(b: Blocklist, chunks: list[str], hold: bool) -> float:
    keep = b.output_context_chars
    context = ""
    t0 = time.perf_counter()
    for c in chunks:
        b.check_output(context, c)
        context = (context + c)[-keep:]
        if hold:
            b.output_hold(context)
    return (time.perf_counter() - t0) / len(chunks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--terms", type=int, default=10_000)
    ap.add_argument("--chunks", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(2 * a.terms)]
    terms = [" ".join(rng.sample(words, rng.randint(1, 3))) for _ in range(a.terms)]
    b = Blocklist(terms, terms_max=a.terms, term_chars_max=128)
    chunks = [" " + rng.choice(words) for _ in range(a.chunks)]
    alone: list[float] = []
    held: list[float] = []
    for _ in range(a.rounds):
        alone.append(run(b, chunks, hold=False))
        held.append(run(b, chunks, hold=True))
    print(f"{len(b):,} terms (1-3 words), {a.chunks:,} one-word chunks, {a.rounds} rounds alternated")
    print(f"check_output alone (before):      best {min(alone):6.1f} us/chunk, median {statistics.median(alone):6.1f}")
    print(f"check_output + output_hold (now): best {min(held):6.1f} us/chunk, median {statistics.median(held):6.1f}")
    print(f"added by the hold-back window:    {min(held) - min(alone):6.1f} us/chunk (best rounds)")


if __name__ == "__main__":
    main()
