"""The one model catalog (infra.models.catalog): the default file, validation with one-line
errors, pinned versions and weights, tier access, and every process resolving the same versions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.models.catalog import (
    DEFAULT_CATALOG_PATH,
    CatalogError,
    EngineKind,
    ModelFileMissing,
    ModelNotAllowed,
    UnknownModel,
    WeightsMismatch,
    load_catalog,
    parse_catalog,
    weights_digest,
)
from infra.models.tokens import count_input_tokens, fallback_token_estimate
from schemas.codes import Tier
from infra.harness.models import SIM_ALIAS, TEST_CATALOG_PATH

ROOT = Path(__file__).resolve().parents[2]
SHA = "ab" * 32


def model_toml(alias: str = "m", **fields: object) -> str:
    base: dict[str, object] = {"version": "m-v1", "engine": "sim", "context_tokens": 100}
    base.update(fields)
    lines = [f"[models.{alias}]"]
    for k, v in base.items():
        if v is None:
            continue
        lines.append(f"{k} = {v!r}".replace("'", '"'))  # Python's repr of str/int/list is TOML here
    return "\n".join(lines) + "\n"


def test_the_default_catalog_pins_smollm2_by_digest_in_its_own_pool_and_lists_no_simulator():
    catalog = load_catalog(DEFAULT_CATALOG_PATH)
    assert set(catalog.models) == {"fast-text-model"}
    m = catalog.get("fast-text-model")
    assert m.engine is EngineKind.CPU
    assert m.version == "smollm2-135m-instruct-q4_1@sha256:b179c9523d0e"
    assert m.pool == "smollm2-135m-instruct-q4_1"  # one pool per model version
    assert m.tiers == frozenset({Tier.FREE, Tier.PAID}) and m.context_tokens == 2048
    assert catalog.policy_models()["fast-text-model"].version == m.version
    assert catalog.pools() == ("smollm2-135m-instruct-q4_1",)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (model_toml(engine="tpu"), "models.m.engine"),
        (model_toml() + model_toml(), "models"),  # a duplicate alias (TOML refuses the second table)
        (model_toml(engine="cpu"), "models.m.weights"),
        (model_toml(engine="cpu", weights="w.gguf"), "models.m.weights_sha256"),
        (model_toml(engine="cpu", weights="w.gguf", weights_sha256="abc"), "models.m.weights_sha256"),
        (model_toml(weights="w.gguf"), "models.m.weights"),
        (model_toml(context_tokens=None), "models.m.context_tokens"),
        (model_toml(context_tokens=0), "models.m.context_tokens"),
        (model_toml(tiers=["gold"]), "models.m.tiers"),
        (model_toml(colour="blue"), "models.m.colour"),
        (model_toml(version="has space"), "models.m.version"),
        (model_toml(pool="a/b"), "models.m.pool"),
        (model_toml(tokenizer="gguf"), "models.m.tokenizer"),
        (model_toml("a", pool="p") + model_toml("b", version="m-v2", pool="p"), "models.b.pool"),
        ("title = 'x'\n", "title"),
        ("", "models"),
        ("[models.m\n", "models"),
    ],
)
def test_an_invalid_catalog_is_one_line_naming_the_field(text: str, field: str):
    with pytest.raises(CatalogError) as err:
        parse_catalog(text, "bad.toml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("model catalog bad.toml: ")
    if field != "models" or "duplicate" in text:
        assert field in message, message


def test_two_aliases_may_share_a_version_and_its_pool():
    text = model_toml("a") + model_toml("b")
    catalog = parse_catalog(text)
    assert catalog.get("a").pool == catalog.get("b").pool == "m-v1" and catalog.pools() == ("m-v1",)


def test_tier_access_and_unknown_aliases():
    catalog = parse_catalog(model_toml("big", tiers=["paid"]))
    assert catalog.resolve("big", Tier.PAID).alias == "big"
    with pytest.raises(ModelNotAllowed):
        catalog.resolve("big", Tier.FREE)
    with pytest.raises(UnknownModel):
        catalog.resolve("nope", Tier.PAID)
    assert catalog.policy_models()["big"].tiers == frozenset({Tier.PAID})


def test_the_pinned_version_names_the_weights_and_only_those_weights_serve_it(tmp_path: Path):
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"weights")
    digest = weights_digest(weights)
    catalog = parse_catalog(model_toml(engine="cpu", weights="w.gguf", weights_sha256=digest), "c.toml", tmp_path)
    m = catalog.get("m")
    assert m.version == f"m-v1@sha256:{digest[:12]}"
    assert m.verify_weights() == weights
    assert m.serves(m.version) and not m.serves("m-v1") and not m.serves(f"m-v1@sha256:{'f' * 12}")
    weights.write_bytes(b"other weights")
    with pytest.raises(WeightsMismatch, match="refusing to serve another version"):
        m.verify_weights()
    weights.unlink()
    with pytest.raises(ModelFileMissing):
        m.verify_weights()


def test_a_model_directory_digests_its_files(tmp_path: Path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.safetensors").write_bytes(b"a")
    first = weights_digest(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_bytes(b"{}")
    assert weights_digest(tmp_path / "model") != first


def test_input_tokens_count_the_trusted_system_instructions_too():
    catalog = load_catalog(DEFAULT_CATALOG_PATH)
    model = catalog.get("fast-text-model")
    short = count_input_tokens(model, [("user", "hi")])
    long = count_input_tokens(model, [("user", "hi " * 200)])
    assert 0 < short < long
    sim = load_catalog(TEST_CATALOG_PATH).get(SIM_ALIAS)
    assert count_input_tokens(sim, [("user", "abcdef")]) == fallback_token_estimate([sim.system_instructions, "abcdef"])
    # The fallback never under-counts English text (3 bytes per token is more than BPE averages).
    assert fallback_token_estimate(["hello world"]) >= 3


# --- every process reads the same file ----------------------------------------------------------

TWO_MODELS = """
[models.alpha]
version = "alpha-v3"
engine = "sim"
context_tokens = 4096

[models.beta]
version = "beta-v1"
engine = "sim"
pool = "shared-beta"
tiers = ["paid"]
context_tokens = 8192
"""


def test_processor_edge_and_worker_resolve_every_alias_to_the_same_version(tmp_path: Path, monkeypatch):
    from edge.app import Edge
    from edge.settings import EdgeSettings
    from projections.ledger.settings import ProcessorSettings
    from workers.__main__ import served_model
    from workers.settings import WorkerSettings

    path = tmp_path / "models.toml"
    path.write_text(TWO_MODELS)
    monkeypatch.setenv("CHATPLANE_MODEL_CATALOG", str(path))
    processor = ProcessorSettings().policy.models
    edge_settings = EdgeSettings()
    edge = Edge(edge_settings)
    for alias in ("alpha", "beta"):
        worker_model, weights = served_model(WorkerSettings(model_alias=alias), "sim")
        assert weights is None
        versions = {processor[alias].version, edge_settings.policy.models[alias].version,
                    edge.catalog.get(alias).version, worker_model.version}
        assert versions == {f"{alias}-v3" if alias == "alpha" else "beta-v1"}, versions
        assert processor[alias].pool == worker_model.pool
    assert processor["beta"].pool == "shared-beta" and processor["alpha"].pool == "alpha-v3"


BROKEN = '[models.m]\nversion = "m-v1"\nengine = "tpu"\ncontext_tokens = 10\n'


@pytest.mark.parametrize(
    "argv",
    [["-m", "projections"], ["-m", "edge"], ["-m", "workers", "--engine", "sim"]],
    ids=["processor", "edge", "worker"],
)
def test_an_invalid_catalog_stops_each_process_at_start_with_one_line(tmp_path: Path, argv: list[str]):
    path = tmp_path / "models.toml"
    path.write_text(BROKEN)
    env = {**os.environ, "CHATPLANE_MODEL_CATALOG": str(path),
           "CHATPLANE_KAFKA_BOOTSTRAP": "127.0.0.1:1", "CHATPLANE_WORKER_MODEL_ALIAS": "m"}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "models.m.engine" in lines[0] and "unknown engine 'tpu'" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_a_sim_worker_for_the_real_models_alias_refuses_to_start():
    env = {**os.environ, "CHATPLANE_KAFKA_BOOTSTRAP": "127.0.0.1:1", "CHATPLANE_WORKER_MODEL_ALIAS": "fast-text-model"}
    proc = subprocess.run([sys.executable, "-m", "workers", "--engine", "sim"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "engine 'sim' cannot serve fast-text-model" in lines[0], proc.stderr
