"""The deployment artifacts, checked offline: Kubernetes manifests (per overlay) against the Kubernetes
and KEDA schemas, docker-compose.yml against the Compose specification, Prometheus rules through a real
PromQL parser, the Grafana dashboard, the Dockerfiles. kubectl (kustomize) and promtool add their own
checks where they are installed. Vendored schemas: tests/data/deploy/README.md."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from typer.main import get_command

from app.cli import cli
from app.core.config import DEFAULT_MODEL, Settings
from app.core.keys import Keys
from app.workers.celery_app import PRIORITY_STEPS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DATA = ROOT / "tests" / "data" / "deploy"
OVERLAYS = ["cpu-dev", "gpu-prod"]
K8S_VERSION = "1.30.0"  # one of the versions kubernetes-validate bundles
STAGES = 2
METRICS_PORT = "9100"

# Every metric the rules and the dashboard may use: the application's, Prometheus' own `up`, and the
# defaults of prometheus_client. A name outside this list is a typo or a metric nobody exports.
HISTOGRAMS = {
    "conveyor_http_request_duration_seconds",
    "conveyor_intake_wait_seconds",
    "conveyor_batch_size",
    "conveyor_batch_padding_ratio",
    "conveyor_partition_latency_seconds",
    "conveyor_time_to_first_token_seconds",
    "conveyor_inter_token_latency_seconds",
    "conveyor_job_latency_seconds",
}
KNOWN_METRICS = {f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")} | {
    "conveyor_http_requests_total",
    "conveyor_intake_depth",
    "conveyor_tokens_generated_total",
    "conveyor_jobs_total",
    "conveyor_admission_refused_total",
    "conveyor_breaker_state",
    "conveyor_workers_live",
    "conveyor_worker_heartbeat_timestamp_seconds",
    "conveyor_device_memory_used_bytes",
    "conveyor_device_memory_total_bytes",
    "conveyor_device_utilization_ratio",
    "conveyor_device_temperature_celsius",
    "up",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_start_time_seconds",
}
REQUIRED_ALERTS = {
    "HighPartitionLatency",
    "HighEndToEndLatencyP99",
    "HighErrorRate",
    "JobFailureRate",
    "QueueDepthGrowing",
    "CircuitBreakerOpen",
    "WorkerMissing",
}


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def setting_names() -> set[str]:
    return {name.upper() for name in Settings.model_fields}


# --- Kustomize, the subset these overlays use ---------------------------------------------------

KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
KUSTOMIZE_FIELDS |= {"secretGenerator", "generatorOptions"}
CLUSTER_SCOPED = {"Namespace"}
# Strategic merge: lists of these fields merge item by item on the key (Kubernetes' patchMergeKey).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name"}
MERGE_KEYS |= {
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "topologySpreadConstraints": "topologyKey",
}
BUILTIN_KINDS = {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "HorizontalPodAutoscaler"}
BUILTIN_KINDS |= {"PodDisruptionBudget", "Namespace"}


def merge(base: dict[str, Any], patch: dict[str, Any], *, strategic: bool) -> None:
    """Strategic merge (built-in kinds) or JSON merge patch (custom resources) of `patch` into `base`."""
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value, strategic=strategic)
        elif strategic and key in MERGE_KEYS and isinstance(value, list) and isinstance(base.get(key), list):
            by_key = {item[MERGE_KEYS[key]]: item for item in base[key]}
            for item in value:
                if item[MERGE_KEYS[key]] in by_key:
                    merge(by_key[item[MERGE_KEYS[key]]], item, strategic=True)
                else:
                    base[key].append(copy.deepcopy(item))
        else:
            base[key] = copy.deepcopy(value)


def env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [doc["spec"]["template"]["spec"]] if doc["kind"] in {"Deployment", "StatefulSet"} else []


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What `kustomize build directory` makes of the fields in KUSTOMIZE_FIELDS."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= KUSTOMIZE_FIELDS, f"{directory}: fields this test does not render"
    docs: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        docs += kustomize(path) if path.is_dir() else load_yaml_docs(path)
    for generator in spec.get("secretGenerator", []):
        assert spec["generatorOptions"]["disableNameSuffixHash"] is True
        data = {k: v for env in generator["envs"] for k, v in env_file(directory / env).items()}
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        meta = {"name": generator["name"]}
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"})
        docs[-1]["data"] = encoded
    for patch_ref in spec.get("patches", []):
        assert set(patch_ref) == {"path"}, "only strategic-merge patch files"
        for patch in load_yaml_docs(directory / patch_ref["path"]):
            name = patch["metadata"]["name"]
            targets = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (patch["kind"], name)]
            assert len(targets) == 1, f"{patch_ref['path']}: {patch['kind']}/{name} matches {len(targets)}"
            merge(targets[0], patch, strategic=patch["kind"] in BUILTIN_KINDS)
    for image in spec.get("images", []):
        for pod in (p for d in docs for p in pod_specs(d)):
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = spec["namespace"]
    return docs


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(K8S / "overlays" / request.param)


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = find(docs, kind, name)
    return doc


def conveyor_containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container that runs the Conveyor image."""
    return [
        (d, c)
        for d in docs
        for p in pod_specs(d)
        for c in p["containers"]
        if c["image"].split(":")[0] == "conveyor"
    ]


def test_kustomizations_name_files_that_exist():
    directories = [K8S / "base"] + [K8S / "overlays" / o for o in OVERLAYS]
    for directory in directories:
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
        paths = spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]
        paths += [env for g in spec.get("secretGenerator", []) for env in g["envs"]]
        for path in paths:
            assert (directory / path).exists(), f"{directory}: {path} does not exist"
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    assert {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"} == listed


KUSTOMIZE = ["kustomize", "build"] if shutil.which("kustomize") else ["kubectl", "kustomize"]


@pytest.mark.skipif(shutil.which(KUSTOMIZE[0]) is None, reason="neither kustomize nor kubectl installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_kustomize_itself_renders_what_this_test_validates(name: str):
    argv = [*KUSTOMIZE, str(K8S / "overlays" / name)]
    built = [d for d in yaml.safe_load_all(subprocess.run(argv, check=True, capture_output=True).stdout) if d]

    def keyed(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        for secret in find(docs, "Secret"):  # kustomize folds long base64 lines
            secret["data"] = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert keyed(built) == keyed(kustomize(K8S / "overlays" / name))


def strict(schema: Any) -> Any:
    """A CRD schema as `kubectl apply --validate=strict` reads it: an unknown field is an error."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


KEDA_SCHEMA = strict(json.loads((DATA / "keda-scaledobject-v1alpha1.schema.json").read_text()))


def test_manifests_match_the_kubernetes_and_keda_schemas(overlay):
    _, docs = overlay
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] == "keda.sh/v1alpha1":
            assert doc["kind"] == "ScaledObject", where
            jsonschema.Draft7Validator(KEDA_SCHEMA).validate(doc)
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == "conveyor", where
        for pod in pod_specs(doc):  # the "restricted" Pod Security Standard the namespace enforces
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
            for container in pod["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
                assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], where
    labels = one(docs, "Namespace", "conveyor")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_processes_run_real_commands_with_real_settings(overlay):
    _, docs = overlay
    commands = set(get_command(cli).commands)  # type: ignore[attr-defined]
    config = one(docs, "ConfigMap", "conveyor-config")["data"]
    secrets = {s["metadata"]["name"]: s for s in find(docs, "Secret")}
    for key in config.keys() | secrets["conveyor-secrets"]["data"].keys():
        if key.startswith("CONVEYOR_"):
            assert key.removeprefix("CONVEYOR_") in setting_names(), f"unknown setting {key}"
    assert config["CONVEYOR_STAGES"] == str(STAGES) and config["CONVEYOR_METRICS_PORT"] == METRICS_PORT
    for workload, container in conveyor_containers(docs):
        where = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001, where
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef") or source["secretRef"]
            assert find(docs, "ConfigMap", ref["name"]) or ref["name"] in secrets, f"{where}: {ref}"
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            assert ref is None or ref["name"] in secrets, f"{where}: {ref}"
        command = container["command"]
        if command[0] == "conveyor":
            assert command[1] in commands, f"{where}: unknown command {command}"
        else:
            assert "celery --broker" in container["args"][0] and " flower " in container["args"][0], where


def http_probe(container: dict[str, Any], probe: str) -> tuple[int, str]:
    get = container[probe]["httpGet"]
    return get["port"], get["path"]


def test_probes_and_scrape_annotations(overlay):
    _, docs = overlay
    for workload, container in conveyor_containers(docs):
        name = workload["metadata"]["name"]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for p in container["ports"]}, name
        if name == "api":
            assert (port, annotations["prometheus.io/path"]) == (8000, "/metrics")
            assert http_probe(container, "livenessProbe") == (8000, "/healthz")
            assert http_probe(container, "readinessProbe") == (8000, "/readyz")
        elif name == "flower":
            assert port == 5555 and http_probe(container, "livenessProbe") == (5555, "/healthcheck")
        else:
            assert (port, annotations["prometheus.io/path"]) == (int(METRICS_PORT), "/metrics"), name
            assert http_probe(container, "livenessProbe") == (int(METRICS_PORT), "/metrics"), name


def test_stages_scale_on_their_celery_queues(overlay):
    _, docs = overlay
    config = one(docs, "ConfigMap", "conveyor-config")["data"]
    keys = Keys(config.get("CONVEYOR_NAMESPACE", Settings.model_fields["namespace"].default))
    model = config.get("CONVEYOR_DEFAULT_MODEL", DEFAULT_MODEL)
    scaled = find(docs, "ScaledObject")
    assert len(scaled) == STAGES
    for stage in range(STAGES):
        deployment = one(docs, "Deployment", f"stage{stage}")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["conveyor", "worker", "--stage", str(stage), "--stages", str(STAGES)]
        assert "replicas" not in deployment["spec"], "KEDA owns the replica count"
        (so,) = [s for s in scaled if s["spec"]["scaleTargetRef"]["name"] == f"stage{stage}"]
        assert so["spec"]["minReplicaCount"] >= 1
        assert so["spec"]["maxReplicaCount"] >= so["spec"]["minReplicaCount"]
        # One trigger per broker priority list of the stage's queue (app.workers.celery_app).
        queue = keys.stage_queue(model, stage)
        lists = [queue] + [f"{queue}:{step}" for step in PRIORITY_STEPS[1:3]]
        assert [t["metadata"]["listName"] for t in so["spec"]["triggers"]] == lists
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] == "redis"
            assert int(trigger["metadata"]["listLength"]) > 0
            assert trigger["metadata"]["addressFromEnv"] in config  # read from the scaled container's env
            assert re.fullmatch(r"[\w.-]+:\d+", config[trigger["metadata"]["addressFromEnv"]])


def test_services_budgets_and_autoscalers_select_real_pods(overlay):
    _, docs = overlay
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs if pod_specs(d)}
    for doc in docs:
        if pod_specs(doc):
            assert doc["spec"]["selector"]["matchLabels"].items() <= pods[doc["metadata"]["name"]].items()

    def selected(selector: dict[str, str]) -> set[str]:
        return {name for name, labels in pods.items() if selector.items() <= labels.items()}

    for service in find(docs, "Service"):
        assert selected(service["spec"]["selector"]), service["metadata"]["name"]
    budgets = {
        d["metadata"]["name"]: selected(d["spec"]["selector"]["matchLabels"])
        for d in find(docs, "PodDisruptionBudget")
    }
    assert budgets["api"] == {"api"}
    assert all(budgets[f"stage{s}"] == {f"stage{s}"} for s in range(STAGES))
    (hpa,) = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "api"
    assert "replicas" not in one(docs, "Deployment", "api")["spec"], "the HPA owns the replica count"
    batcher = one(docs, "Deployment", "batcher")["spec"]
    assert batcher["replicas"] == 1 and batcher["strategy"]["type"] == "Recreate"
    assert {"webhooks-dispatcher", "callbacks", "flower"} <= pods.keys()
    commands = {c["command"][-1] for _, c in conveyor_containers(docs) if c["command"][0] == "conveyor"}
    assert {"dispatcher", "worker"} <= commands


def mebibytes(quantity: str) -> int:
    """A Kubernetes quantity (Mi, Gi) or a Redis size (mb, gb: binary units too) in MiB."""
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi|mb|gb)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * (1024 if unit in {"Gi", "gb"} else 1)


def test_redis_is_durable_and_never_evicts(overlay):
    _, docs = overlay
    redis = one(docs, "StatefulSet", "redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    options = dict(zip(args[1::2], args[2::2], strict=False))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "everysec"
    assert options["--maxmemory-policy"] == "noeviction"
    limit = container["resources"]["limits"]["memory"]
    assert mebibytes(options["--maxmemory"]) < mebibytes(limit), "maxmemory must stay under the memory limit"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    assert one(docs, "ConfigMap", "conveyor-config")["data"]["REDIS_URL"].startswith("redis://redis:6379")


def test_overlays_differ_where_they_should(overlay):
    name, docs = overlay
    config = one(docs, "ConfigMap", "conveyor-config")["data"]
    images = {c["image"] for _, c in conveyor_containers(docs)}
    gpus = {
        d["metadata"]["name"]: c["resources"]
        for d, c in conveyor_containers(docs)
        if "nvidia.com/gpu" in str(c["resources"])
    }
    if name == "cpu-dev":
        assert images == {"conveyor:cpu"} and config["CONVEYOR_DEVICE"] == "cpu" and not gpus
        assert one(docs, "HorizontalPodAutoscaler", "api")["spec"]["minReplicas"] == 1
        assert all(s["spec"]["minReplicaCount"] == 1 for s in find(docs, "ScaledObject"))
        return
    assert images == {"conveyor:cuda"} and config["CONVEYOR_DEVICE"] == "auto"
    assert set(gpus) == {f"stage{s}" for s in range(STAGES)}
    for stage, resources in gpus.items():
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1"
        assert (resources["requests"]["memory"], resources["limits"]["memory"]) == ("32Gi", "48Gi")
        pod = one(docs, "Deployment", stage)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert one(docs, "HorizontalPodAutoscaler", "api")["spec"]["minReplicas"] >= 3


def test_example_secrets_are_examples_that_load(monkeypatch: pytest.MonkeyPatch):
    from app.api.auth import JwtVerifier
    from app.webhooks.signing import SecretBook

    values = env_file(K8S / "base" / "secrets.example.env")
    assert "EXAMPLE" in (K8S / "base" / "secrets.example.env").read_text()
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in settings.api_keys)
    JwtVerifier(settings)
    assert SecretBook(settings.webhook_secrets).default
    assert ":" in env_file(K8S / "base" / "flower.example.env")["FLOWER_BASIC_AUTH"]


# --- docker-compose ------------------------------------------------------------------------------

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CONVEYOR_SERVICES = {n for n, s in COMPOSE["services"].items() if s.get("image", "").startswith("conveyor")}


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set in the environment, and `$$` for a literal `$`."""
    value = re.sub(r"(?<!\$)\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    return value.replace("$$", "$")


def test_compose_file_matches_the_compose_specification():
    schema = json.loads((DATA / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(COMPOSE)


def test_compose_services_run_real_commands_with_real_settings(monkeypatch: pytest.MonkeyPatch):
    services = COMPOSE["services"]
    expected = {"redis", "api", "batcher", "stage0", "stage1", "webhooks", "callbacks", "flower"}
    assert expected | {"prometheus", "grafana"} <= set(services)
    assert expected - {"redis"} == CONVEYOR_SERVICES
    commands = set(get_command(cli).commands)  # type: ignore[attr-defined]
    for name in CONVEYOR_SERVICES:
        service = services[name]
        env = {k: interpolate(str(v)) for k, v in service["environment"].items()}
        assert env["CONVEYOR_METRICS_PORT"] == METRICS_PORT and env["CONVEYOR_STAGES"] == str(STAGES), name
        for var in env:
            if var.startswith("CONVEYOR_"):
                assert var.removeprefix("CONVEYOR_") in setting_names(), f"{name}: unknown setting {var}"
                monkeypatch.setenv(var, env[var])
        Settings()  # every value parses
        command = service["command"]
        if command[0] == "conveyor":
            assert command[1] in commands, f"{name}: unknown command {command[1]}"
    for stage in range(STAGES):
        assert services[f"stage{stage}"]["command"][-4:] == ["--stage", str(stage), "--stages", str(STAGES)]
    assert services["webhooks"]["command"] == ["conveyor", "webhooks", "dispatcher"]
    assert services["callbacks"]["command"] == ["conveyor", "webhooks", "worker"]
    assert "--basic-auth" in services["flower"]["command"][-1] and "5555:5555" in services["flower"]["ports"]
    redis = services["redis"]
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert "noeviction" in redis["command"]


def test_compose_prometheus_and_grafana_see_what_runs():
    services = COMPOSE["services"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scraped = set()
    for job in config["scrape_configs"]:
        for target in (t for group in job["static_configs"] for t in group["targets"]):
            host, port = target.split(":")
            if host == "localhost":
                continue
            assert host in services, f"{job['job_name']}: no service {host}"
            expected = {"api": "8000", "flower": "5555"}.get(host, METRICS_PORT)
            assert port == expected, target
            scraped.add(host)
    assert scraped == CONVEYOR_SERVICES
    mounts = dict(v.rsplit(":", 2)[:2] for v in services["grafana"]["volumes"] if v.startswith("./"))
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/conveyor.yml").read_text())
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


# --- Prometheus ----------------------------------------------------------------------------------

RULES = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
ALERTS = {rule["alert"]: rule for group in RULES["groups"] for rule in group["rules"]}


def query_facts(expr: str) -> tuple[set[str], set[str], set[float]]:
    """Metric names, aggregation labels and histogram_quantile levels of a PromQL expression."""
    metrics: set[str] = set()
    labels: set[str] = set()
    levels: set[float] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            metrics.add(node.name)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
            levels.add(node.args[0].val)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return metrics, labels, levels


def test_known_metrics_are_the_ones_the_application_exports():
    from prometheus_client import REGISTRY

    import app.api.metrics  # noqa: F401  (importing registers the metric families)
    import app.core.metrics  # noqa: F401

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    exported = {f.name + s for f in REGISTRY.collect() for s in suffixes.get(f.type, [""])}
    assert KNOWN_METRICS - {"up"} <= exported, KNOWN_METRICS - {"up"} - exported


def test_rules_are_well_formed_and_use_real_metrics():
    assert REQUIRED_ALERTS <= ALERTS.keys()
    for group in RULES["groups"]:
        assert set(group) == {"name", "rules"}
    for name, rule in ALERTS.items():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert {"summary", "description"} <= rule["annotations"].keys(), name
        metrics, _, _ = query_facts(rule["expr"])
        assert metrics <= KNOWN_METRICS, f"{name}: unknown metrics {metrics - KNOWN_METRICS}"
    seed = (
        "sum by (partition_id) (rate(conveyor_partition_latency_seconds_sum[5m]))"
        " / sum by (partition_id) (rate(conveyor_partition_latency_seconds_count[5m])) > 0.5"
    )
    assert str(promql_parser.parse(ALERTS["HighPartitionLatency"]["expr"])) == str(promql_parser.parse(seed))
    assert ALERTS["HighPartitionLatency"]["for"] == ALERTS["HighEndToEndLatencyP99"]["for"] == "5m"
    assert query_facts(ALERTS["HighEndToEndLatencyP99"]["expr"])[2] == {0.99}
    assert ALERTS["CircuitBreakerOpen"]["for"] == "1m" and ALERTS["WorkerMissing"]["for"] == "2m"


def test_rule_jobs_match_the_scrape_configs():
    compose_jobs = {
        j["job_name"]
        for j in yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())["scrape_configs"]
    }
    components = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in kustomize(K8S / "overlays" / OVERLAYS[0])
        if pod_specs(d)
    }
    (regex,) = re.findall(r'up\{job=~"([^"]+)"\}', ALERTS["WorkerMissing"]["expr"])
    assert set(regex.split("|")) <= compose_jobs & components
    k8s = yaml.safe_load((DEPLOY / "prometheus/prometheus-k8s.yml").read_text())
    (job,) = k8s["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    sources = {label for r in job["relabel_configs"] for label in r.get("source_labels", [])}
    for annotation in ("scrape", "port", "path"):
        assert f"__meta_kubernetes_pod_annotation_prometheus_io_{annotation}" in sources
    for config in (DEPLOY / "prometheus/prometheus.yml", DEPLOY / "prometheus/prometheus-k8s.yml"):
        assert yaml.safe_load(config.read_text())["rule_files"] == ["rules.yml"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_rules_and_configs():
    prom = DEPLOY / "prometheus"
    subprocess.run(["promtool", "check", "rules", str(prom / "rules.yml")], check=True)
    for config in ("prometheus.yml", "prometheus-k8s.yml"):
        subprocess.run(["promtool", "check", "config", "--syntax-only", str(prom / config)], check=True)


def test_every_alert_has_a_row_in_the_operations_guide():
    guide = (ROOT / "docs" / "operations.md").read_text()
    for name in ALERTS:
        assert re.search(rf"^\| `?{name}`? \|", guide, re.MULTILINE), f"docs/operations.md: no row for {name}"


# --- Grafana -------------------------------------------------------------------------------------

DASHBOARD = json.loads((DEPLOY / "grafana/dashboards/conveyor.json").read_text())
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$model": ".*"}
# view -> (a metric its panel queries, labels it groups by, the quantiles it shows)
VIEWS: dict[str, tuple[str, set[str], set[float]]] = {
    "end-to-end latency": ("conveyor_job_latency_seconds_bucket", set(), {0.5, 0.9, 0.99}),
    "time to first token": ("conveyor_time_to_first_token_seconds_bucket", set(), {0.5, 0.9, 0.99}),
    "tokens/s": ("conveyor_tokens_generated_total", set(), set()),
    "jobs/s": ("conveyor_jobs_total", {"status"}, set()),
    "HTTP errors by status": ("conveyor_http_requests_total", {"status"}, set()),
    "job failures by reason": ("conveyor_jobs_total", {"reason"}, set()),
    "queue depth by priority": ("conveyor_intake_depth", {"priority"}, set()),
    "batch size": ("conveyor_batch_size_bucket", set(), set()),
    "per-partition latency": ("conveyor_partition_latency_seconds_sum", {"partition_id"}, set()),
    "device memory": ("conveyor_device_memory_used_bytes", set(), set()),
    "device temperature": ("conveyor_device_temperature_celsius", set(), set()),
    "breaker state": ("conveyor_breaker_state", set(), set()),
    "live workers": ("conveyor_workers_live", {"stage"}, set()),
}


def panel_facts(panel: dict[str, Any]) -> tuple[set[str], set[str], set[float]]:
    metrics: set[str] = set()
    labels: set[str] = set()
    levels: set[float] = set()
    for target in panel["targets"]:
        expr = target["expr"]
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        m, lab, lev = query_facts(expr)
        metrics, labels, levels = metrics | m, labels | lab, levels | lev
    return metrics, labels, levels


def test_dashboard_shows_every_view_from_the_provisioned_datasource():
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    panels = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    for variable in DASHBOARD["templating"]["list"]:
        assert variable["datasource"]["uid"] == uid
        assert f"${variable['name']}" in GRAFANA_VARIABLES
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == uid for t in panel["targets"]), panel[
            "title"
        ]
        metrics, _, _ = panel_facts(panel)
        assert metrics <= KNOWN_METRICS, f"{panel['title']}: unknown metrics {metrics - KNOWN_METRICS}"
    facts = [panel_facts(p) for p in panels]
    for view, (metric, labels, levels) in VIEWS.items():
        assert any(metric in m and labels <= lab and levels <= lev for m, lab, lev in facts), (
            f"no {view} panel"
        )


def test_dashboard_layout_is_sound():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


# --- Dockerfiles ---------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line and line[0] != "#"
    ]


def stages(path: Path) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(base image or stage, stage name, instructions) per FROM, ARG defaults substituted."""
    args: dict[str, str] = {}
    out: list[tuple[str, str, list[tuple[str, str]]]] = []
    for op, rest in instructions(path):
        if op == "ARG" and "=" in rest and not out:
            key, value = rest.split("=", 1)
            args[key] = value
        elif op == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest).split()
            out.append((words[0], words[2] if len(words) > 2 else "", []))
        elif out:
            out[-1][2].append((op, rest))
    return out


def dockerignore() -> set[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_build_a_slim_unprivileged_image(name: str):
    path = DEPLOY / "docker" / name
    built = stages(path)
    assert len(built) >= 2, "multi-stage"
    by_name = {stage_name: (base, ops) for base, stage_name, ops in built}
    base, _, ops = built[-1]
    user = None
    while user is None:
        user = next((rest for op, rest in reversed(ops) if op == "USER"), None)
        if base not in by_name:
            break
        base, ops = by_name[base]
    assert user is not None and user.split(":")[0] not in {"root", "0"}, "the final image runs as root"
    runs = " ".join(rest for _, _, ops in built for op, rest in ops if op == "RUN")
    assert re.search(r"pip (wheel|install)[^&]* torch==2\.13\.0", runs)
    assert "conveyor model pull" in runs
    every = [(op, rest) for _, _, ops in built for op, rest in ops]
    assert any(op == "HEALTHCHECK" for op, _ in every)
    assert any(op == "ENV" and "CONVEYOR_HOME=/var/lib/conveyor" in rest for op, rest in every)
    ignored = dockerignore()
    for op, rest in every:
        if op == "COPY" and "--from" not in rest:
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists() and source not in ignored, f"COPY {source}"
    if name == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu" in runs
    else:
        assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-runtime-ubuntu22\.04", built[0][0])
        assert "python3.11" in runs


def test_dockerignore_keeps_local_state_out():
    ignored = dockerignore()
    assert {".venv", ".conveyor", ".git", ".pytest_cache", "bench/results"} <= ignored
