"""The model registry: pinned versions, tier access, the processor's catalog, input token counting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from control_plane.policy import ModelEntry
from schemas.codes import Tier
from workers.registry import (
    DEFAULT_ALIAS,
    ModelNotAllowed,
    RegisteredModel,
    Registry,
    UnknownModel,
    count_input_tokens,
    fallback_token_estimate,
    pinned_version,
    policy_models,
)


def test_pinned_version_names_the_weights_by_digest(tmp_path: Path):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"weights")
    v = pinned_version("m", f)
    assert re.fullmatch(r"m@sha256:[0-9a-f]{12}", v)
    f.write_bytes(b"other weights")
    assert pinned_version("m", f) != v


def test_policy_models_is_the_processor_catalog_with_the_default_alias():
    models = policy_models()
    entry = models[DEFAULT_ALIAS]
    assert isinstance(entry, ModelEntry) and entry.pool == "default"
    assert entry.version.startswith("smollm2-135m-instruct-q4_1")
    assert entry.tiers == frozenset({Tier.FREE, Tier.PAID})


def test_tier_access_and_unknown_aliases():
    paid_only = RegisteredModel("big", "big@sha256:0123456789ab", "sglang", tiers=frozenset({Tier.PAID}))
    reg = Registry({"big": paid_only})
    assert reg.resolve("big", Tier.PAID) is paid_only
    with pytest.raises(ModelNotAllowed):
        reg.resolve("big", Tier.FREE)
    with pytest.raises(UnknownModel):
        reg.resolve("nope", Tier.PAID)
    assert reg.policy_models()["big"].tiers == frozenset({Tier.PAID})


def test_a_worker_serves_its_pinned_version_and_the_name_only_catalog_entry():
    m = RegisteredModel("a", "smollm2@sha256:0123456789ab", "cpu")
    assert m.serves("smollm2@sha256:0123456789ab") and m.serves("smollm2")
    assert not m.serves("smollm2@sha256:ffffffffffff") and not m.serves("other")


def test_input_tokens_count_the_trusted_system_instructions_too():
    short = count_input_tokens(DEFAULT_ALIAS, [("user", "hi")])
    long = count_input_tokens(DEFAULT_ALIAS, [("user", "hi " * 200)])
    assert 0 < short < long
    sim = RegisteredModel("s", "s@sim", "sim", system_instructions="")
    assert count_input_tokens("s", [("user", "abcdef")], Registry({"s": sim})) == fallback_token_estimate(["", "abcdef"])
    # The fallback never under-counts English text (3 bytes per token is more than BPE averages).
    assert fallback_token_estimate(["hello world"]) >= 3
