"""Benchmark of input-token counting at the edge (``infra.models.tokens.count_input_tokens``).

A script, not a test. ``edge.tokens.input_token_counter`` calls it with the catalog's model: every
POST counts its input with the model's tokenizer before any work. The baseline, in the same run, is
the prompt itself: the model's chat template rendered over the trusted system instructions and the
client's messages, and tokenized as the CPU engine runs it (``llama_prompt_ids``; llama-cpp-python
0.3.x tokenizes each text twice when the model is loaded vocabulary-only, to learn the buffer size).
Now: the template's framing is measured once per weights file, and each text is counted in one
``llama_tokenize`` pass. Both must give the same count.

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

from infra.models.catalog import DEFAULT_CATALOG_PATH, CatalogModel, load_catalog  # noqa: E402
from infra.models.tokens import _vocab, count_input_tokens, llama_chat_render, llama_prompt_ids, vocabulary_path  # noqa: E402
from workers.engines.cpu import cpu_runtime_missing_reason  # noqa: E402

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


def baseline_counter(model: CatalogModel, path: str):
    """The rendered prompt's token count: the ids the CPU engine runs for the system turn and the messages."""
    vocab = _vocab(path)
    render = llama_chat_render(vocab)  # once, as an engine builds it once

    def count(messages: list[tuple[str, str]]) -> int:
        return len(llama_prompt_ids(vocab, render, [("system", model.system_instructions), *messages]))

    return count


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
    # The default catalog's model, the one cpu_runtime_missing_reason checked.
    model = load_catalog(DEFAULT_CATALOG_PATH).get(ALIAS)
    path = vocabulary_path(model)
    if path is None:
        print(f"bench_tokens: {ALIAS} has no usable GGUF vocabulary here (the edge uses the byte estimate); nothing to measure")
        return 2
    baseline = baseline_counter(model, path)
    reqs = requests(args.requests)
    count_input_tokens(model, reqs[0])  # load the vocabulary and measure the framing once, outside the timings
    baseline(reqs[0])
    # alternate, so drift on a shared machine hits both
    base_t, base_c, new_t, new_c = [], [], [], []
    for half in (reqs[: len(reqs) // 2], reqs[len(reqs) // 2:]):
        t, c = timed(baseline, half)
        base_t += t
        base_c += c
        t, c = timed(lambda r: count_input_tokens(model, r), half)
        new_t += t
        new_c += c
    assert base_c == new_c, "counts differ"
    mean_bytes = statistics.mean(sum(len(c.encode()) for _, c in r) for r in reqs)
    print(f"requests: {len(reqs)}, client bytes per request: mean {mean_bytes:.0f}; counts equal: {base_c == new_c}")
    print(f"{'':<38}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name, t in (("baseline (render + tokenize prompt)", base_t), ("count_input_tokens (now)", new_t)):
        print(f"{name:<38}{us(t, 50):>10}{us(t, 99):>10}{statistics.mean(t) * 1e6:>10.1f}")
    print(f"speed-up (mean): x{statistics.mean(base_t) / statistics.mean(new_t):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
