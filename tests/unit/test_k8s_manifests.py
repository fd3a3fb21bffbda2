"""The Kubernetes manifests (``infra/k8s``, docs/k8s.md) render and validate against real schemas.

Each kustomization (the base and the GPU overlay) is rendered with kustomize, and every object is
validated, strictly (unknown fields are errors), against:

- the Kubernetes built-in kinds' JSON schemas of the ``kubernetes-validate`` package (Kubernetes
  ``K8S_VERSION``);
- the operators' CRDs: Strimzi's ``Kafka``, ``KafkaNodePool`` and ``KafkaTopic`` (``kafka.strimzi.io/v1``),
  cass-operator's ``CassandraDatacenter`` and KEDA's ``ScaledObject``, which ``infra/k8s-tools`` brings
  from their published artifacts (versions in that script).

An object of a kind no schema covers fails too. The negative tests show the validator catches a
wrong type, a missing required field and an unknown field. The rest checks what the schemas cannot:
the generated topics and keyspace match the schema, the edge's grace period covers its drain, the
processor's instance id and data dir, secrets, scrape annotations and the autoscalers' metrics.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from edge.settings import EdgeSettings
from infra.k8s import generate
from infra.models.catalog import DEFAULT_CATALOG_PATH, load_catalog
from infra.runtime.kafka_admin import deployment_topics
from schemas import topics as T  # noqa: N812
from workers.worker import DRAIN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu"}
# The Kubernetes version whose schemas the built-in kinds are checked against (the pod-index label
# and the preStop sleep action the edge uses are on by default from 1.28 and 1.30).
K8S_VERSION = "1.33"
TOOLS_TIMEOUT_S = 900  # a first run builds kustomize and downloads the CRDs (about a minute here)
PRODUCT = ("schemas", "control_plane", "infra", "projections", "edge", "workers")


@dataclass(frozen=True)
class Tools:
    kustomize: Path
    crd_files: tuple[Path, ...]


@pytest.fixture(scope="session")
def tools() -> Tools:
    """infra/k8s-tools (idempotent: a cached run returns at once)."""
    done = subprocess.run(
        [str(ROOT / "infra" / "k8s-tools")], capture_output=True, text=True, timeout=TOOLS_TIMEOUT_S, cwd=ROOT
    )
    assert done.returncode == 0, f"infra/k8s-tools failed:\n{done.stderr[-4000:]}"
    cache = Path(done.stdout.strip().splitlines()[-1])
    return Tools(cache / "bin" / "kustomize", tuple(sorted((cache / "crds").glob("*/*.yaml"))))


# --- CRD schemas ----------------------------------------------------------------------------------


def strict_schema(node: Any) -> Any:
    """A CRD's OpenAPI v3 structural schema as a JSON schema, strict as the API server is: an object
    with ``properties`` takes no other field unless ``x-kubernetes-preserve-unknown-fields`` says so.
    ``x-kubernetes-int-or-string`` is either; ``nullable`` admits null. A node that preserves unknown
    fields is not held to its declared type: the API server keeps whatever JSON it gets there
    (cass-operator's ``spec.config`` is declared a string and written as an object)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = strict_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [strict_schema(sub) for sub in value]
        elif not key.startswith("x-kubernetes-") and key != "nullable":
            out[key] = value
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("allOf", []).append({"anyOf": [{"type": "integer"}, {"type": "string"}]})
    if preserve and out.get("type") not in (None, "object"):
        out.pop("type")
    if "properties" in node and not preserve and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@pytest.fixture(scope="session")
def crd_schemas(tools: Tools) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict JSON schema, for every served version of every CRD brought."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in tools.crd_files:
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    schema = strict_schema(version["schema"]["openAPIV3Schema"])
                    out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = schema
    assert ("kafka.strimzi.io/v1", "KafkaTopic") in out and ("cassandra.datastax.com/v1beta1", "CassandraDatacenter") in out
    return out


def schema_errors(obj: dict[str, Any], crd_schemas: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Every way ``obj`` breaks its kind's schema (empty: valid)."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in crd_schemas:
        validator = jsonschema.Draft7Validator(crd_schemas[key])
        return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {key[0]} {key[1]} (neither Kubernetes {K8S_VERSION} nor a CRD brought by infra/k8s-tools)"]
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.absolute_path)) or '<root>'}: {exc.message}"]
    return []


# --- rendering ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rendered(tools: Tools) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, path in KUSTOMIZATIONS.items():
        done = subprocess.run([str(tools.kustomize), "build", str(path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kustomize build {path.relative_to(ROOT)}: {done.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def config_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return objects(docs, "ConfigMap")["chatplane-env"]["data"]


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_object_validates_against_its_schema(name: str, rendered: dict, crd_schemas: dict) -> None:
    docs = rendered[name]
    assert len(docs) > 20
    failures = {f"{d['kind']}/{d['metadata']['name']}": errs for d in docs if (errs := schema_errors(d, crd_schemas))}
    assert not failures, failures
    kinds = {d["kind"] for d in docs}
    for kind in ("Kafka", "KafkaNodePool", "KafkaTopic", "CassandraDatacenter", "ScaledObject", "Job",
                 "StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"):
        assert kind in kinds, f"{name} renders no {kind}"


def _first(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for d in docs if d["kind"] == kind))


def test_the_validator_catches_invalid_objects(rendered: dict, crd_schemas: dict) -> None:
    docs = rendered["gpu"]

    topic = _first(docs, "KafkaTopic")
    topic["spec"]["partitions"] = "8"  # a string where the CRD says integer
    assert any("partitions" in e and "is not of type 'integer'" in e for e in schema_errors(topic, crd_schemas))

    deployment = _first(docs, "Deployment")
    del deployment["spec"]["selector"]  # required by apps/v1
    assert any("'selector' is a required property" in e for e in schema_errors(deployment, crd_schemas))

    statefulset = _first(docs, "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"  # misspelt: unknown field
    assert schema_errors(statefulset, crd_schemas)

    # (cass-operator's spec preserves unknown fields, as the API server does: only types and required ones.)
    datacenter = _first(docs, "CassandraDatacenter")
    del datacenter["spec"]["size"]
    datacenter["spec"]["storageConfig"]["cassandraDataVolumeClaimSpec"]["accessModes"] = "ReadWriteOnce"  # not a list
    errors = schema_errors(datacenter, crd_schemas)
    assert any("'size' is a required property" in e for e in errors) and any("accessModes" in e for e in errors)

    scaled = _first(docs, "ScaledObject")
    scaled["spec"]["minReplicaCount"] = "2"
    assert any("minReplicaCount" in e for e in schema_errors(scaled, crd_schemas))

    node_pool = _first(docs, "KafkaNodePool")
    node_pool["spec"]["roles"] = ["zookeeper"]  # not a role of the enum
    assert any("roles" in e for e in schema_errors(node_pool, crd_schemas))

    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert any("no schema" in e for e in schema_errors(unknown, crd_schemas))

    # And the unmodified objects are valid: the errors above come from the changes.
    for kind in ("KafkaTopic", "Deployment", "StatefulSet", "CassandraDatacenter", "ScaledObject", "KafkaNodePool"):
        assert schema_errors(_first(docs, kind), crd_schemas) == []


# --- generated from the schema --------------------------------------------------------------------


def test_generated_files_match_the_schema() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in generate.outputs().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"out of date with the schema: {stale} (run python -m infra.k8s.generate)"


def _topics(docs: list[dict[str, Any]]) -> dict[str, tuple[int, dict[str, str]]]:
    return {
        d["spec"]["topicName"]: (d["spec"]["partitions"], {k: str(v) for k, v in d["spec"]["config"].items()})
        for d in docs
        if d["kind"] == "KafkaTopic"
    }


def test_rendered_topics_are_the_deployments_topics(rendered: dict) -> None:
    def expected(catalog_path: Path) -> dict[str, tuple[int, dict[str, str]]]:
        specs = deployment_topics(T.Topology(""), load_catalog(catalog_path))
        return {s.name: (s.partitions, s.configs()) for s in specs}

    assert _topics(rendered["base"]) == expected(DEFAULT_CATALOG_PATH)
    assert _topics(rendered["gpu"]) == expected(generate.GPU_CATALOG)
    for topic in objects(rendered["gpu"], "KafkaTopic").values():
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == objects(rendered["gpu"], "Kafka").popitem()[0]


def test_keyspace_job_runs_the_generated_cql(rendered: dict) -> None:
    docs = rendered["base"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("chatplane-keyspace")]
    assert cm["data"]["keyspace.cql"] == generate.keyspace_cql()
    job = objects(docs, "Job")["chatplane-keyspace"]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cql"]["configMap"]["name"] == cm["metadata"]["name"]
    datacenter = objects(docs, "CassandraDatacenter")[generate.CASSANDRA_DATACENTER]
    service = f"{datacenter['spec']['clusterName']}-{generate.CASSANDRA_DATACENTER}-service"
    assert service in job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert config_env(docs)["CHATPLANE_CASSANDRA_HOSTS"] == service


# --- what the schemas cannot check ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_edges_drain_inside_their_grace_period_on_their_own_inbox_partitions(name: str, rendered: dict) -> None:
    docs = rendered[name]
    edge = objects(docs, "StatefulSet")["edge"]
    pod = edge["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    defaults = EdgeSettings.__dataclass_fields__
    drain_s = float(env.get("CHATPLANE_EDGE_DRAIN_DEADLINE_S", {}).get("value", defaults["drain_deadline_s"].default))
    cancel_s = float(env.get("CHATPLANE_EDGE_DRAIN_CANCEL_WAIT_S", {}).get("value", defaults["drain_cancel_wait_s"].default))
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    uvicorn_shutdown_s = 5  # docs/edge.md: the grace must exceed deadline + cancel wait + 5 s
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s + cancel_s + uvicorn_shutdown_s
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == int(env["CHATPLANE_EDGE_PORT"]["value"])
    assert env["CHATPLANE_EDGE_HOST"]["value"] == "0.0.0.0"
    # One inbox partition per edge: the pod's ordinal, and never more edges than partitions.
    assert env["CHATPLANE_EDGE_INBOX_PARTITION"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    scaler = objects(docs, "ScaledObject")["edge"]
    assert scaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "edge"}
    assert scaler["spec"]["maxReplicaCount"] <= T.EDGE_INBOX_PARTITIONS
    # Not sticky: each edge's bucket share is for the largest fleet.
    assert env["CHATPLANE_EDGE_USERS_STICKY"]["value"] == "0"
    assert int(env["CHATPLANE_EDGE_REPLICAS"]["value"]) == scaler["spec"]["maxReplicaCount"]
    service = objects(docs, "Service")["edge"]
    assert service["spec"]["selector"].items() <= edge["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_processor_keeps_its_instance_id_and_data_dir(name: str, rendered: dict) -> None:
    processor = objects(rendered[name], "StatefulSet")["processor"]
    assert processor["spec"]["replicas"] <= T.USER_PARTITIONS
    (container,) = processor["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert env["CHATPLANE_PROCESSOR_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in processor["spec"]["volumeClaimTemplates"]}
    assert mounts[env["CHATPLANE_DATA_DIR"]["value"]] in claims


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_workers_drain_and_scale_with_warm_capacity(name: str, rendered: dict) -> None:
    docs = rendered[name]
    workers = {n: d for n, d in objects(docs, "Deployment").items() if n.startswith("worker-")}
    assert set(workers) == ({"worker-cpu", "worker-gpu"} if name == "gpu" else {"worker-cpu"})
    scalers = objects(docs, "ScaledObject")
    for worker_name, deployment in workers.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > DRAIN_TIMEOUT_S
        scaler = scalers[worker_name]["spec"]
        assert scaler["scaleTargetRef"]["name"] == worker_name
        assert scaler["minReplicaCount"] >= 1  # warm capacity: never scaled to zero
        assert {t["name"] for t in scaler["triggers"]} == {"queue_age", "token_load"}
        # The queries select this pool's pods by the instance label Prometheus maps from the pod.
        instance = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"]
        for trigger in scaler["triggers"]:
            assert f'app_kubernetes_io_instance="{instance}"' in trigger["metadata"]["query"]


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_each_worker_serves_a_model_of_the_catalog_it_reads(name: str, rendered: dict) -> None:
    for deployment_name, template in pod_specs(rendered[name]):
        if not deployment_name.startswith("worker-"):
            continue
        (container,) = template["spec"]["containers"]
        env = env_of(container)
        catalog = DEFAULT_CATALOG_PATH
        if "CHATPLANE_MODEL_CATALOG" in env:
            mount = {m["mountPath"]: m for m in container["volumeMounts"]}[str(Path(env["CHATPLANE_MODEL_CATALOG"]["value"]).parent)]
            volume = {v["name"]: v for v in template["spec"]["volumes"]}[mount["name"]]
            assert volume["configMap"]["name"].startswith("chatplane-catalog")
            catalog = generate.GPU_CATALOG
        model = load_catalog(catalog).get(env["CHATPLANE_WORKER_MODEL_ALIAS"]["value"])
        engine = container["command"][container["command"].index("--engine") + 1]
        assert engine == model.engine.value
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is not None) == (engine == "sglang")


def test_every_process_reads_the_same_catalog_in_the_gpu_overlay(rendered: dict) -> None:
    for workload in ("processor", "edge", "worker-cpu", "worker-gpu"):
        template = dict(pod_specs(rendered["gpu"]))[workload]
        (container,) = template["spec"]["containers"]
        assert env_of(container)["CHATPLANE_MODEL_CATALOG"]["value"] == "/etc/chatplane/catalog/models.toml", workload


def _product_sources() -> str:
    return "\n".join(p.read_text() for top in PRODUCT for p in (ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_settings_are_real_variables_and_secrets_come_from_secrets(name: str, rendered: dict) -> None:
    docs = rendered[name]
    sources = _product_sources()
    names = set(config_env(docs))
    for _, template in pod_specs(docs):
        for container in template["spec"]["containers"]:
            names |= {n for n in env_of(container) if n.startswith("CHATPLANE_")}
    unknown = sorted(n for n in names if f'"{n}"' not in sources)
    assert not unknown, f"CHATPLANE_* variables no process reads: {unknown}"
    assert "CHATPLANE_DEV_MODE" not in names  # built-in development secrets only outside Kubernetes
    assert not objects(docs, "Secret"), "secrets are created by the operator of the cluster, never committed"
    edge_env = env_of(objects(docs, "StatefulSet")["edge"]["spec"]["template"]["spec"]["containers"][0])
    for var in ("CHATPLANE_EDGE_JWT_SECRET", "CHATPLANE_FINGERPRINT_KEY"):
        assert set(edge_env[var]) == {"name", "valueFrom"} and "secretKeyRef" in edge_env[var]["valueFrom"], var


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_scrape_annotations_name_the_port_each_process_serves_metrics_on(name: str, rendered: dict) -> None:
    docs = rendered[name]
    scraped = 0
    for workload, template in pod_specs(docs):
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        scraped += 1
        (container,) = template["spec"]["containers"]
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for p in container["ports"]}, workload
        env = env_of(container)
        port_vars = [v for v in env if v.endswith("_METRICS_PORT") or v == "CHATPLANE_EDGE_PORT"]
        assert len(port_vars) == 1 and int(env[port_vars[0]]["value"]) == port, workload
    assert scraped == len([w for w, _ in pod_specs(docs)]) - 1  # every process but the keyspace job
    assert config_env(docs)["CHATPLANE_METRICS_HOST"] == "0.0.0.0"


def test_autoscalers_query_metrics_the_processes_register(rendered: dict) -> None:
    sources = _product_sources()
    queried = set()
    for scaler in objects(rendered["gpu"], "ScaledObject").values():
        for trigger in scaler["spec"]["triggers"]:
            queried |= set(re.findall(r"chatplane_[a-z_]+", trigger["metadata"]["query"]))
    assert queried
    for metric in sorted(queried):
        family = re.sub(r"_bucket$", "", metric)
        # Scraped gauges are registered as f"chatplane_worker_{name}" (workers/metrics.py).
        registered = f'"{family}"' in sources or (
            family.startswith("chatplane_worker_") and f'("{family.removeprefix("chatplane_worker_")}",' in sources
        )
        assert registered, f"{metric}: no process registers it"


# The install order of docs/k8s.md: each step applies the objects labelled with it.
INSTALL_STEPS = ("config", "kafka", "topics", "cassandra", "keyspace", "processor", "readmodel", "workers", "edge")


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_object_belongs_to_a_documented_install_step(name: str, rendered: dict) -> None:
    steps = {f"{d['kind']}/{d['metadata']['name']}": d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
             for d in rendered[name]}
    assert {s for s in steps.values()} <= set(INSTALL_STEPS), {k: s for k, s in steps.items() if s not in INSTALL_STEPS}
    doc = (ROOT / "docs" / "k8s.md").read_text()
    positions = [doc.find(f"kubectl apply -k $K -l app.kubernetes.io/component={step}\n") for step in INSTALL_STEPS]
    assert -1 not in positions and positions == sorted(positions), dict(zip(INSTALL_STEPS, positions))
