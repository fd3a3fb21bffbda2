"""The one settings loader (``infra.runtime.settings``): typed, checked at start, one line per bad value.

Every process's settings class reads its ``CHATPLANE_*`` variables through ``setting``/``env_value``; a
value that does not parse or breaks its bound is a ``SettingsError`` naming the variable, the value and
what was expected, and each entry point turns it into that one line on stderr and exit status 2. The
edge's request bounds come from the same settings (``edge.routes.generations.request_model_for``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from edge.app import create_app
from edge.settings import EdgeSettings
from projections.ledger.settings import ProcessorSettings
from infra.stores.schema import ReadModelSettings
from edge.settings import DEV_FINGERPRINT_KEY, DEV_JWT_SECRET
from infra.runtime.settings import DEV_MODE_ENV, SETTINGS_ERROR_EXIT_STATUS, SettingsError, env_value, policy_from_env
from schemas.codes import RejectionCode
from tests.unit.test_edge import BODY, FakeDecider, assert_typed, hdrs
from workers.engines.sim import SimConfig
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test starts from the defaults: no CHATPLANE_* variable from the calling shell, but development
    mode as in the whole run (tests/conftest.py), so the edge may use its built-in secrets."""
    for name in [n for n in os.environ if n.startswith("CHATPLANE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(DEV_MODE_ENV, "1")


# --- the loader's rules -----------------------------------------------------------------------------


def test_a_value_that_does_not_parse_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv("CHATPLANE_EDGE_PORT", "abc")
    with pytest.raises(SettingsError) as caught:
        EdgeSettings()
    assert str(caught.value) == "CHATPLANE_EDGE_PORT='abc': expected an integer"


@pytest.mark.parametrize(
    ("build", "var", "raw", "expected"),
    [
        (EdgeSettings, "CHATPLANE_EDGE_PORT", "70000", "an integer >= 1 and <= 65535"),
        (EdgeSettings, "CHATPLANE_EDGE_DECISION_TIMEOUT_S", "0", "a number > 0"),
        (EdgeSettings, "CHATPLANE_EDGE_READ_MODEL", "yes", '"1", "true", "0" or "false"'),
        (EdgeSettings, "CHATPLANE_EDGE_JWT_ALGORITHM", "none", "one of HS256, RS256"),
        (EdgeSettings, "CHATPLANE_DEV_MODE", "yes", '"1", "true", "0" or "false"'),
        (EdgeSettings, "CHATPLANE_MAX_OUTPUT_TOKENS_MAX", "0", "an integer >= 1"),  # the shared policy
        (ProcessorSettings, "CHATPLANE_PROCESSOR_SESSION_TIMEOUT_S", "-1", "a number > 0"),
        (ProcessorSettings, "CHATPLANE_PROCESSOR_PENDING_MAX", "2k", "an integer"),
        (ProcessorSettings, "CHATPLANE_FAULT_SKIP_DELIVERIES", "0-5", "partition:offset pairs, comma-separated"),
        (ProcessorSettings, "CHATPLANE_CONCURRENCY_LIMIT", "0", "an integer >= 1"),
        (ProcessorSettings, "CHATPLANE_DEDUP_RECORDS_PER_USER_MAX", "0", "an integer >= 1"),
        (WorkerSettings, "CHATPLANE_WORKER_SLOTS", "two", "an integer"),
        (WorkerSettings, "CHATPLANE_WORKER_FREE_MIN_SHARE", "1.5", "a number >= 0 and <= 1"),
        (WorkerSettings, "CHATPLANE_WORKER_RESULT_STORE", "redis", "one of cassandra, none"),
        (WorkerSettings, "CHATPLANE_WORKER_HEARTBEAT_INTERVAL_S", "nan", "a number"),
        (ReadModelSettings, "CHATPLANE_CASSANDRA_PORT", "9042x", "an integer"),
        (ReadModelSettings, "CHATPLANE_CASSANDRA_HOSTS", " , ", "comma-separated host names"),
        (ReadModelSettings, "CHATPLANE_CASSANDRA_KEYSPACE", "ks; DROP", "a plain CQL identifier"),
        (ReadModelSettings, "CHATPLANE_READ_DEADLINE_S", "-0.5", "a number > 0"),
        (SimConfig.from_env, "CHATPLANE_SIM_CRASH_AFTER_TOKENS", "3.5", "an integer"),
    ],
)
def test_each_process_refuses_a_bad_value_in_one_line(monkeypatch, build, var, raw, expected):
    monkeypatch.setenv(var, raw)
    with pytest.raises(SettingsError) as caught:
        build()
    message = str(caught.value)
    assert message == f"{var}={raw!r}: expected {expected}"
    assert "\n" not in message


def test_a_relation_between_two_variables_names_both(monkeypatch):
    monkeypatch.setenv("CHATPLANE_RESULT_TTL_S", "7200")
    monkeypatch.setenv("CHATPLANE_GENERATION_METADATA_TTL_S", "3600")
    with pytest.raises(SettingsError, match="CHATPLANE_RESULT_TTL_S=7200, CHATPLANE_GENERATION_METADATA_TTL_S=3600"):
        ReadModelSettings()


def test_the_decision_deadline_margin_must_leave_time_to_decide(monkeypatch):
    monkeypatch.setenv("CHATPLANE_EDGE_DECISION_TIMEOUT_S", "0.5")
    monkeypatch.setenv("CHATPLANE_EDGE_DECISION_SKEW_MARGIN_MS", "500")
    with pytest.raises(SettingsError, match="CHATPLANE_EDGE_DECISION_SKEW_MARGIN_MS=500, CHATPLANE_EDGE_DECISION_TIMEOUT_S=0.5"):
        EdgeSettings()
    monkeypatch.setenv("CHATPLANE_EDGE_DECISION_SKEW_MARGIN_MS", "200")
    s = EdgeSettings()
    # The deadline falls the margin before the edge stops waiting.
    assert s.decide_by_ms(1_000_000) == 1_000_000 + 500 - 200
    assert EdgeSettings(decision_timeout_s=2.0).decision_skew_margin_ms == 200
    monkeypatch.delenv("CHATPLANE_EDGE_DECISION_SKEW_MARGIN_MS")
    assert EdgeSettings(decision_timeout_s=2.0).decision_skew_margin_ms == 300  # the default


def test_a_value_with_a_newline_stays_one_line(monkeypatch):
    monkeypatch.setenv("CHATPLANE_EDGE_STREAMS_MAX", "1\n2")
    with pytest.raises(SettingsError) as caught:
        EdgeSettings()
    assert "\n" not in str(caught.value) and "CHATPLANE_EDGE_STREAMS_MAX" in str(caught.value)


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("0", False), ("false", False)])
def test_booleans_are_strict(monkeypatch, raw, value):
    monkeypatch.setenv("CHATPLANE_EDGE_USERS_STICKY", raw)
    assert EdgeSettings().users_sticky is value


def test_unset_or_empty_means_the_default_and_values_are_typed(monkeypatch):
    monkeypatch.setenv("CHATPLANE_EDGE_PORT", "")
    s = EdgeSettings()
    assert s.port == 8080 and s.users_sticky is True and s.decision_timeout_s == 2.0
    monkeypatch.setenv("CHATPLANE_EDGE_PORT", "9000")
    monkeypatch.setenv("CHATPLANE_EDGE_BUCKET_CAPACITY", "5")
    monkeypatch.setenv("CHATPLANE_CASSANDRA_HOSTS", "a, b,")
    monkeypatch.setenv("CHATPLANE_FAULT_SKIP_DELIVERIES", "0:5,1:9")
    s = EdgeSettings()
    assert s.port == 9000 and isinstance(s.bucket_capacity_tokens, float) and s.bucket_capacity_tokens == 5.0
    assert ReadModelSettings().hosts == ("a", "b")
    assert ProcessorSettings().fault_skip_deliveries == frozenset({(0, 5), (1, 9)})
    assert env_value("CHATPLANE_SIM_STALL_AFTER_TOKENS", None, kind=int) is None


def test_keyword_overrides_and_replace_do_not_read_the_environment(monkeypatch):
    s = EdgeSettings(decision_timeout_s=1.0, read_model=False)
    assert s.decision_timeout_s == 1.0 and s.read_model is False
    monkeypatch.setenv("CHATPLANE_EDGE_DECISION_TIMEOUT_S", "abc")  # a replace copies, it does not re-read
    assert dataclasses.replace(s, port=9001).port == 9001
    worker = WorkerSettings(worker_id="w1", model_alias="m")
    assert dataclasses.replace(worker, slots=2).worker_id == "w1"
    with pytest.raises(SettingsError, match="CHATPLANE_WORKER_RESULT_STORE='redis'"):
        WorkerSettings(result_store="redis")  # a relation checked for code-given values too


def test_the_policy_is_built_by_the_same_loader(monkeypatch):
    monkeypatch.setenv("CHATPLANE_QUEUE_WAIT_MAX_MS", "3000")
    monkeypatch.setenv("CHATPLANE_MAX_OUTPUT_TOKENS_MAX", "8192")
    policy = policy_from_env()
    assert policy.queue_wait_max_ms == 3000 and policy.max_output_tokens_max == 8192
    assert EdgeSettings().policy.max_output_tokens_max == ProcessorSettings().policy.max_output_tokens_max == 8192


# --- secrets: required outside development mode ------------------------------------------------------


def test_outside_dev_mode_each_unset_secret_stops_the_edge_in_one_line_naming_it(monkeypatch):
    monkeypatch.delenv(DEV_MODE_ENV)
    with pytest.raises(SettingsError) as caught:
        EdgeSettings()
    assert str(caught.value).startswith("CHATPLANE_EDGE_JWT_SECRET is unset: ") and "\n" not in str(caught.value)
    monkeypatch.setenv("CHATPLANE_EDGE_JWT_SECRET", "s" * 32)
    with pytest.raises(SettingsError, match="^CHATPLANE_FINGERPRINT_KEY is unset: "):
        EdgeSettings()
    monkeypatch.setenv("CHATPLANE_FINGERPRINT_KEY", "f" * 32)
    s = EdgeSettings()
    assert (s.jwt_secret, s.fingerprint_key, s.uses_dev_secrets) == ("s" * 32, "f" * 32, False)
    with pytest.raises(SettingsError, match="^CHATPLANE_EDGE_JWT_SECRET is unset: "):
        EdgeSettings(jwt_secret="")  # checked for values from code too


def test_dev_mode_is_explicit_and_allows_the_built_in_secrets_only_when_unset(monkeypatch):
    s = EdgeSettings()
    assert (s.dev_mode, s.jwt_secret, s.fingerprint_key, s.uses_dev_secrets) == (True, DEV_JWT_SECRET, DEV_FINGERPRINT_KEY, True)
    monkeypatch.setenv("CHATPLANE_EDGE_JWT_SECRET", "s" * 32)
    assert EdgeSettings().jwt_secret == "s" * 32
    monkeypatch.setenv(DEV_MODE_ENV, "0")
    monkeypatch.setenv("CHATPLANE_FINGERPRINT_KEY", DEV_FINGERPRINT_KEY)  # the public value, copied by hand
    with pytest.raises(SettingsError, match="^CHATPLANE_FINGERPRINT_KEY is the public built-in development secret"):
        EdgeSettings()
    monkeypatch.delenv(DEV_MODE_ENV)
    assert EdgeSettings.__dataclass_fields__["dev_mode"].default_factory() is False  # off by default


def test_only_what_the_token_algorithm_needs_is_required(monkeypatch, tmp_path):
    monkeypatch.delenv(DEV_MODE_ENV)
    monkeypatch.setenv("CHATPLANE_FINGERPRINT_KEY", "f" * 32)
    monkeypatch.setenv("CHATPLANE_EDGE_JWT_ALGORITHM", "RS256")
    with pytest.raises(SettingsError, match="^CHATPLANE_EDGE_JWKS_PATH, CHATPLANE_EDGE_JWKS_URL and CHATPLANE_EDGE_OIDC_DISCOVERY are unset: "):
        EdgeSettings()
    monkeypatch.setenv("CHATPLANE_EDGE_JWKS_PATH", str(tmp_path / "jwks.json"))
    assert EdgeSettings().jwt_secret == ""  # no HS256 secret needed, none made up
    monkeypatch.delenv("CHATPLANE_EDGE_JWKS_PATH")
    monkeypatch.setenv("CHATPLANE_EDGE_JWKS_URL", "https://id.example/jwks.json")
    assert EdgeSettings().jwks_url == "https://id.example/jwks.json"


def test_cors_origins_are_an_explicit_list(monkeypatch):
    monkeypatch.setenv("CHATPLANE_EDGE_CORS_ORIGINS", "https://app.example.com, http://127.0.0.1:3000")
    assert EdgeSettings().cors_origin_list == ["https://app.example.com", "http://127.0.0.1:3000"]
    for bad in ("*", "app.example.com", "https://app.example.com/"):
        monkeypatch.setenv("CHATPLANE_EDGE_CORS_ORIGINS", bad)
        with pytest.raises(SettingsError, match="^CHATPLANE_EDGE_CORS_ORIGINS: "):
            EdgeSettings()


@pytest.mark.parametrize("module", ["edge", "edge.mint_token"])
def test_the_edge_and_the_mint_command_refuse_to_start_without_secrets_outside_dev_mode(module):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_")}
    done = subprocess.run([sys.executable, "-m", module, *(["--user", "a"] if module == "edge.mint_token" else [])],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=ENTRY_POINT_TIMEOUT_S)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == SETTINGS_ERROR_EXIT_STATUS, done.stderr
    assert len(lines) == 1 and lines[0].startswith("CHATPLANE_EDGE_JWT_SECRET is unset: "), done.stderr
    assert done.stdout == ""  # no token minted


def test_in_dev_mode_the_edge_gets_past_its_settings_and_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_")}
    # No broker at this address: the edge stops at Kafka, after its settings were accepted.
    env |= {DEV_MODE_ENV: "1", "CHATPLANE_KAFKA_BOOTSTRAP": "127.0.0.1:1", "CHATPLANE_EDGE_READ_MODEL": "0",
            "CHATPLANE_EDGE_PORT": "1"}
    done = subprocess.run([sys.executable, "-m", "edge"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=ENTRY_POINT_TIMEOUT_S)
    assert done.returncode not in (0, SETTINGS_ERROR_EXIT_STATUS), done.stderr
    assert "development mode: built-in development secrets in use" in done.stderr
    assert "is unset" not in done.stderr


# --- API bounds come from the settings --------------------------------------------------------------


async def test_a_raised_output_token_ceiling_is_honoured_and_documented(monkeypatch):
    monkeypatch.setenv("CHATPLANE_MAX_OUTPUT_TOKENS_MAX", "8192")
    settings = EdgeSettings(capacity_check=False, read_model=False, messages_count_max=3)
    app = create_app(settings)
    fake = FakeDecider()
    app.state.edge.client = fake
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as http:
        allowed = await http.post("/v1/generations", json={**BODY, "max_output_tokens": 8192}, headers=hdrs(settings, key="k1"))
        over = await http.post("/v1/generations", json={**BODY, "max_output_tokens": 8193}, headers=hdrs(settings, key="k2"))
    assert_typed(allowed, RejectionCode.QUOTA_EXHAUSTED)  # the fake's answer: the command was appended
    assert [c.max_output_tokens for c in fake.commands] == [8192]
    assert assert_typed(over, RejectionCode.INVALID_REQUEST)["details"] == {"field": "max_output_tokens", "limit": 8192}
    request = app.openapi()["components"]["schemas"]["GenerationRequest"]["properties"]
    assert request["max_output_tokens"]["maximum"] == 8192
    assert request["messages"]["maxItems"] == 3


# --- entry points: one line on stderr, exit status 2 --------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "var", "raw"),
    [
        ([sys.executable, "-m", "edge"], "CHATPLANE_EDGE_PORT", "abc"),
        ([sys.executable, "-m", "projections.ledger.processor"], "CHATPLANE_PROCESSOR_PENDING_MAX", "0"),
        ([sys.executable, "-m", "workers"], "CHATPLANE_WORKER_SLOTS", "abc"),
        ([sys.executable, "-m", "projections.readmodel"], "CHATPLANE_CASSANDRA_PORT", "abc"),
        ([str(ROOT / "infra" / "status")], "CHATPLANE_KAFKA_PORT", "abc"),
        ([sys.executable, "-m", "edge"], "CHATPLANE_LOG_LEVEL", "loud"),
        ([sys.executable, "-m", "projections"], "CHATPLANE_LOG_LEVEL", "loud"),
        ([sys.executable, "-m", "workers"], "CHATPLANE_WORKER_ENGINE", "tpu"),
    ],
    ids=["edge", "processor", "workers", "readmodel", "infra", "edge-log-level", "processor-log-level", "worker-engine"],
)
def test_entry_points_exit_2_with_one_line(argv, var, raw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPLANE_")}
    env[var] = raw
    if argv[0] != sys.executable:
        env["CHATPLANE_PYTHON"] = sys.executable
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=ENTRY_POINT_TIMEOUT_S)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == SETTINGS_ERROR_EXIT_STATUS, done.stderr
    assert len(lines) == 1 and f"{var}={raw!r}: expected" in lines[0], done.stderr
