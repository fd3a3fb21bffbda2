"""Benchmark of input-token counting at the edge (``workers.registry.count_input_tokens``).

A script, not a test. Every POST counts its input with the model's tokenizer before any work. The
baseline, in the same run, is what it did before: ``Llama.tokenize`` on every message including
the model's trusted system instructions (llama-cpp-python 0.3.x tokenizes each text twice when the
model is loaded vocabulary-only, to learn the buffer size). Now: the instructions are counted once
per model, and each client message in one ``llama_tokenize`` pass. Both must give the same count.

    .venv/bin/python bench/bench_tokens.py [--requests 3000]

Needs the cpu runtime (llama-cpp-python and the SmolLM2 package: the ``cpu`` extra); without it
the edge uses the byte estimate and there is nothing to measure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.engines.cpu import cpu_runtime_missing_reason  # noqa: E402
from workers.registry import FALLBACK_TOKENS_PER_MESSAGE, _vocab, count_input_tokens, default_registry  # noqa: E402

ALIAS = "fast-text-model"
WORDS = "the quick brown fox jumps over a lazy dog naïve café 漢字 🙂 tokens streaming quota window".split()


def requests(n: int, seed: int = 7) -> list[list[tuple[str, str]]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        turns = rnd.choice((1, 1, 1, 3))
        out.append([("user" if i % 2 == 0 else "assistant", " ".join(rnd.choices(WORDS, k=rnd.randint(5, 200))))
                    for i in range(turns)])
    return out


def baseline(messages: list[tuple[str, str]]) -> int:
    model = default_registry().get(ALIAS)
    vocab = _vocab(str(model.weights_path))
    texts = [model.system_instructions, *(content for _role, content in messages)]
    return sum(len(vocab.tokenize(t.encode(), add_bos=False, special=False)) + FALLBACK_TOKENS_PER_MESSAGE for t in texts)


def timed(fn, reqs) -> tuple[list[float], list[int]]:
    times, counts = [], []
    for r in reqs:
        t0 = time.perf_counter()
        counts.append(fn(r))
        times.append(time.perf_counter() - t0)
    return times, counts


def us(xs: list[float], q: float) -> str:
    return f"{statistics.quantiles(xs, n=100)[int(q) - 1] * 1e6:.1f}" if q < 100 else f"{max(xs) * 1e6:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    missing = cpu_runtime_missing_reason()
    if missing is not None:
        print(f"bench_tokens: cpu runtime not installed ({missing}); nothing to measure")
        return 2
    reqs = requests(args.requests)
    count_input_tokens(ALIAS, reqs[0])  # load the vocabulary once, outside the timings
    baseline(reqs[0])
    # alternate, so drift on a shared machine hits both
    base_t, base_c, new_t, new_c = [], [], [], []
    for half in (reqs[: len(reqs) // 2], reqs[len(reqs) // 2:]):
        t, c = timed(baseline, half)
        base_t += t
        base_c += c
        t, c = timed(lambda r: count_input_tokens(ALIAS, r), half)
        new_t += t
        new_c += c
    assert base_c == new_c, "counts differ"
    mean_bytes = statistics.mean(sum(len(c.encode()) for _, c in r) for r in reqs)
    print(f"requests: {len(reqs)}, client bytes per request: mean {mean_bytes:.0f}; counts equal: {base_c == new_c}")
    print(f"{'':<34}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name, t in (("baseline (Llama.tokenize, all)", base_t), ("count_input_tokens (now)", new_t)):
        print(f"{name:<34}{us(t, 50):>10}{us(t, 99):>10}{statistics.mean(t) * 1e6:>10.1f}")
    print(f"speed-up (mean): x{statistics.mean(base_t) / statistics.mean(new_t):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
