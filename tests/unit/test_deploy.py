"""The Kubernetes manifests, checked offline per overlay: against the Kubernetes and KEDA schemas, and
for what they must say (real commands and settings, probes, scaling on the stage queues, budgets,
durable Redis with a password, no committed secret, read-only containers without service-account
tokens, NetworkPolicies). The overlays render only with their secrets/ files, which git ignores: the
tests write fresh ones into a copy (deploy_render.with_secrets). kubectl (kustomize) adds its own
rendering where installed. Vendored schemas: tests/data/deploy/README.md."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from deploy_render import (
    CLUSTER_SCOPED,
    DATA,
    K8S,
    K8S_VERSION,
    METRICS_PORT,
    OVERLAYS,
    PUBLISHED_EXAMPLES,
    SECRET_FILES,
    STAGES,
    env_file,
    fresh_secrets,
    kustomize,
    pod_specs,
    render,
    setting_names,
    with_secrets,
)
from typer.main import get_command

from app.batching.budget import REPLICA_BATCHES
from app.cli import cli
from app.core.broker import PRIORITY_STEPS
from app.core.config import DEFAULT_MODEL, Settings
from app.core.keys import Keys

# the deployment manifests: `make test-deploy`, out of the default gate
pytestmark = pytest.mark.deploy


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


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
        for path in paths:
            assert (directory / path).exists(), f"{directory}: {path} does not exist"
        for env in (env for g in spec.get("secretGenerator", []) for env in g["envs"]):
            # Never committed (git ignores secrets/); what goes in it is shown in secrets.example/.
            assert env.startswith("secrets/") and (K8S / "secrets.example" / Path(env).name).is_file(), env
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    assert {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"} == listed


KUSTOMIZE = ["kustomize", "build"] if shutil.which("kustomize") else ["kubectl", "kustomize"]


@pytest.mark.skipif(shutil.which(KUSTOMIZE[0]) is None, reason="neither kustomize nor kubectl installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_kustomize_itself_renders_what_this_test_validates(name: str):
    overlay = with_secrets(name, fresh_secrets())
    argv = [*KUSTOMIZE, str(overlay)]
    built = [d for d in yaml.safe_load_all(subprocess.run(argv, check=True, capture_output=True).stdout) if d]

    def keyed(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        for secret in find(docs, "Secret"):  # kustomize folds long base64 lines
            secret["data"] = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert keyed(built) == keyed(kustomize(overlay))


# --- Secrets: none committed, none published accepted -------------------------------------------


def test_no_secret_is_committed_and_an_overlay_without_its_own_does_not_render():
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert "secretGenerator" not in base and not find(kustomize_base(), "Secret")
    for path in K8S.rglob("*.env"):  # only the templates, every value empty
        assert path.parent == K8S / "secrets.example", f"{path}: a committed env file"
        assert all(v in ("", "{}", "[]") for v in env_file(path).values()), path
    assert "overlays/*/secrets/" in (K8S / ".gitignore").read_text().split()
    for name in OVERLAYS:
        if (K8S / "overlays" / name / "secrets").exists():
            continue  # an operator's own secrets, ignored by git
        with pytest.raises(FileNotFoundError):
            kustomize(K8S / "overlays" / name)
        if shutil.which(KUSTOMIZE[0]):
            built = subprocess.run([*KUSTOMIZE, str(K8S / "overlays" / name)], capture_output=True)
            assert built.returncode != 0, f"{name} rendered without its secrets"


def kustomize_base() -> list[dict[str, Any]]:
    return kustomize(K8S / "base")


def container_env(docs: list[dict[str, Any]], workload: str) -> dict[str, str]:
    """The environment Kubernetes gives a workload's first container: envFrom (ConfigMaps, Secrets),
    then env (Secret references resolved, $(VAR) expanded from what comes before)."""
    pod = next(p for d in docs if d["metadata"]["name"] == workload for p in pod_specs(d))
    container = pod["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            data = one(docs, "Secret", source["secretRef"]["name"])["data"]
            env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = base64.b64decode(one(docs, "Secret", ref["name"])["data"][ref["key"]]).decode()
    return env


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_published_example_secrets_stop_the_api_the_callbacks_worker_and_flower(name, tmp_path):
    from app.api.app import create_app
    from app.core.known_secrets import KnownSecret

    docs = kustomize(with_secrets(name, PUBLISHED_EXAMPLES))
    for workload, setting in [("api", "CONVEYOR_JWT_KEY"), ("callbacks", "CONVEYOR_WEBHOOK_SECRETS")]:
        env = container_env(docs, workload)
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            settings = Settings()
        with pytest.raises(KnownSecret, match=setting):
            create_app(settings)
        with pytest.raises(KnownSecret, match="REDIS_URL"):
            create_app(settings)
    flower = flower_start(docs, tmp_path)
    assert flower.returncode == 1 and "FLOWER_BASIC_AUTH" in flower.stderr

    good = kustomize(with_secrets(name, fresh_secrets()))
    env = container_env(good, "api")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        settings = Settings()
    create_app(settings)  # starts (no request is made: nothing connects yet)
    assert flower_start(good, tmp_path).returncode == 0


def flower_start(docs: list[dict[str, Any]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Flower's container command as its shell runs it, with `celery` a stub that exits 0."""
    (container,) = one(docs, "Deployment", "flower")["spec"]["template"]["spec"]["containers"]
    stub = tmp_path / "bin" / "celery"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    env = dict(container_env(docs, "flower"), PATH=f"{stub.parent}:{os.environ['PATH']}")
    argv = [*container["command"], *container["args"]]
    return subprocess.run(argv, env=env, capture_output=True, text=True)


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
    for key in config.keys() | {k for s in secrets.values() for k in s["data"]}:
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
            assert 'BROKER_URL="$REDIS_URL" exec celery flower ' in container["args"][0], where


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
        redis_triggers = [t for t in so["spec"]["triggers"] if t["type"] == "redis"]
        assert [t["metadata"]["listName"] for t in redis_triggers] == lists
        assert len(so["spec"]["triggers"]) == len(lists) + 1  # and the latency trigger
        for trigger in redis_triggers:
            assert trigger["type"] == "redis"
            # A saturated stage queues more than the target per replica (REPLICA_BATCHES, less the
            # replica's task threads), or KEDA would never see it behind.
            assert 0 < int(trigger["metadata"]["listLength"]) < REPLICA_BATCHES
            assert trigger["metadata"]["addressFromEnv"] in config  # read from the scaled container's env
            assert re.fullmatch(r"[\w.-]+:\d+", config[trigger["metadata"]["addressFromEnv"]])


def test_stages_also_scale_on_the_p99_latency_the_alert_watches(overlay):
    """The seed's scale-up rule (P99 over 0.8 s for 5 minutes) as a Prometheus trigger on every stage:
    its query parses, holds the HighEndToEndLatencyP99 alert's expression for the stack's model, looks
    at 5 minutes of it, and compares with the alert's threshold."""
    _, docs = overlay
    model = one(docs, "ConfigMap", "conveyor-config")["data"].get("CONVEYOR_DEFAULT_MODEL", DEFAULT_MODEL)
    rules = yaml.safe_load((K8S.parent / "prometheus" / "rules.yml").read_text())
    (alert,) = [r for g in rules["groups"] for r in g["rules"] if r["alert"] == "HighEndToEndLatencyP99"]
    condition = promql_parser.parse(alert["expr"])  # histogram_quantile(...) > 0.8
    assert isinstance(condition, promql_parser.BinaryExpr) and isinstance(
        condition.rhs, promql_parser.NumberLiteral
    )
    quantile = str(condition.lhs).replace(
        "conveyor_job_latency_seconds_bucket{}", f'conveyor_job_latency_seconds_bucket{{model="{model}"}}'
    )
    assert quantile != str(condition.lhs)
    for so in find(docs, "ScaledObject"):
        (trigger,) = [t for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
        assert trigger["metricType"] == "Value"  # grows with how far over, not with the replicas
        meta = trigger["metadata"]
        assert float(meta["threshold"]) == condition.rhs.val == 0.8
        assert meta["serverAddress"].startswith("http")
        query = promql_parser.parse(meta["query"])  # raises on a query Prometheus would refuse
        assert quantile in str(query), f"{so['metadata']['name']}: {query}"
        windows = []

        def visit(node: Any, windows: list[float] = windows) -> bool:
            if isinstance(node, promql_parser.SubqueryExpr):
                windows.append(node.range.total_seconds())
            return True

        promql_parser.walk(query, visit)
        assert windows == [promql_parser.parse_duration(alert["for"]).total_seconds()] == [300.0]


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
    containers = {c["name"]: c for c in redis["spec"]["template"]["spec"]["containers"]}
    container = containers["redis"]
    # its metrics come from the redis_exporter beside it (the RedisMemoryHigh alert)
    annotations = redis["spec"]["template"]["metadata"]["annotations"]
    exporter_ports = {p["containerPort"] for p in containers["redis-exporter"]["ports"]}
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and int(annotations["prometheus.io/port"]) in exporter_ports
    )
    args = container["args"]
    options = dict(zip(args[1::2], args[2::2], strict=False))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "everysec"
    assert options["--maxmemory-policy"] == "noeviction"
    limit = container["resources"]["limits"]["memory"]
    assert mebibytes(options["--maxmemory"]) < mebibytes(limit), "maxmemory must stay under the memory limit"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    assert "REDIS_URL" not in one(docs, "ConfigMap", "conveyor-config")["data"]  # it carries the password


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


def test_every_container_is_read_only_without_a_service_account_token(overlay):
    _, docs = overlay
    for doc in docs:
        for pod in pod_specs(doc):
            where = doc["metadata"]["name"]
            assert pod["automountServiceAccountToken"] is False, where
            volumes = {v["name"] for v in pod.get("volumes", [])}
            claims = {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
            for container in pod["containers"]:
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
                mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
                assert "/tmp" in mounts, f"{where}: no writable /tmp"
                assert set(mounts.values()) <= volumes | claims, where
                for name in mounts.values():
                    if name in volumes:  # scratch space, or configuration mounted read-only
                        (volume,) = [v for v in pod["volumes"] if v["name"] == name]
                        (mount,) = [m for m in container["volumeMounts"] if m["name"] == name]
                        read_only = "configMap" in volume and mount.get("readOnly") is True
                        assert "emptyDir" in volume or read_only, f"{where}: {name} is not an emptyDir"


def secrets_of(doc: dict[str, Any]) -> set[str]:
    """The Secrets a workload's pods read (envFrom, env, volumes)."""
    names = set()
    for pod in pod_specs(doc):
        for container in pod["containers"]:
            names |= {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}
            names |= {
                v["valueFrom"]["secretKeyRef"]["name"]
                for v in container.get("env", [])
                if "secretKeyRef" in v.get("valueFrom", {})
            }
        names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    return names


def test_each_pod_mounts_only_the_secrets_it_needs(overlay):
    _, docs = overlay
    needs = {
        "api": {"conveyor-api", "conveyor-webhooks", "conveyor-redis"},  # auth, callbacks' intake
        "callbacks": {"conveyor-webhooks", "conveyor-redis"},  # signs deliveries
        "flower": {"flower-auth", "conveyor-redis"},
        "redis": {"conveyor-redis"},
        "batcher": {"conveyor-redis"},
        "stage0": {"conveyor-redis"},
        "stage1": {"conveyor-redis"},
        "webhooks-dispatcher": {"conveyor-redis"},
        "proxy": set(),
    }
    workloads = {d["metadata"]["name"]: d for d in docs if pod_specs(d)}
    assert set(workloads) == set(needs)
    for name, doc in workloads.items():
        assert secrets_of(doc) == needs[name], name
    assert {s["metadata"]["name"] for s in find(docs, "Secret")} == set().union(*needs.values())
    assert len(SECRET_FILES) == len(find(docs, "Secret"))


def test_redis_requires_a_password_every_client_sends(overlay):
    _, docs = overlay
    containers = one(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if c["name"] == "redis"]
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    password = container_env(docs, "redis")["REDIS_PASSWORD"]
    assert len(password) >= 32
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "REDISCLI_AUTH" in " ".join(container[probe]["exec"]["command"]), probe
    for workload, _ in conveyor_containers(docs) + [(one(docs, "Deployment", "flower"), None)]:
        url = container_env(docs, workload["metadata"]["name"])["REDIS_URL"]
        assert url == f"redis://:{password}@redis:6379/0", workload["metadata"]["name"]
    for so in find(docs, "ScaledObject"):
        for trigger in (t for t in so["spec"]["triggers"] if t["type"] == "redis"):
            assert trigger["metadata"]["passwordFromEnv"] == "REDIS_PASSWORD"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def test_the_proxy_fronts_the_api_with_the_composes_configuration(overlay):
    _, docs = overlay
    conf = one(docs, "ConfigMap", "proxy-nginx")["data"]["nginx.conf"]
    assert conf == (K8S.parent / "nginx" / "nginx.conf").read_text()  # one configuration for both
    assert "server api:8000;" in conf and one(docs, "Service", "api")["spec"]["ports"][0]["port"] == 8000
    proxy = one(docs, "Deployment", "proxy")["spec"]["template"]["spec"]
    (container,) = proxy["containers"]
    assert {
        "mountPath": "/etc/nginx/nginx.conf",
        "name": "config",
        "subPath": "nginx.conf",
        "readOnly": True,
    } in (container["volumeMounts"])
    assert http_probe(container, "readinessProbe") == (8080, "/nginx-healthz")
    assert one(docs, "Service", "proxy")["spec"]["ports"][0]["port"] == 8080


def test_network_policies_deny_by_default_and_open_redis_only_to_conveyor(overlay):
    _, docs = overlay
    policies = {p["metadata"]["name"]: p["spec"] for p in find(docs, "NetworkPolicy")}
    deny = policies["default-deny"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}  # no rule: nothing allowed
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs if pod_specs(d)}

    def ingress_to(workload: str) -> list[dict[str, Any]]:
        return [
            rule
            for spec in policies.values()
            if "Ingress" in spec["policyTypes"] and selects(spec["podSelector"], pods[workload])
            for rule in spec.get("ingress", [])
        ]

    redis_rules = [r for r in ingress_to("redis") if 6379 in {p["port"] for p in r.get("ports", [])}]
    (rule,) = redis_rules
    peers = rule["from"]
    assert all(peers), "an empty peer would admit everything"
    pod_peers = [p["podSelector"] for p in peers if "podSelector" in p]
    assert pod_peers == [{"matchLabels": {"app.kubernetes.io/name": "conveyor"}}]
    assert all(selects(pod_peers[0], labels) for labels in pods.values())  # every Conveyor pod
    namespaces = [p["namespaceSelector"]["matchLabels"] for p in peers if "namespaceSelector" in p]
    assert namespaces == [{"kubernetes.io/metadata.name": "keda"}] and all(
        set(p) == {"namespaceSelector"} or set(p) == {"podSelector"} for p in peers
    )
    proxy_open = [r for r in ingress_to("proxy") if "from" not in r]
    assert [p["port"] for r in proxy_open for p in r["ports"]] == [8080]  # open to all, on its port only
    for workload in pods:
        if workload != "proxy":
            assert all("from" in r for r in ingress_to(workload)), f"{workload} is open to everyone"
    # The api only through the proxy (which holds slow clients off it), and Prometheus for /metrics.
    api_peers = [peer for r in ingress_to("api") for peer in r["from"]]
    assert {"app.kubernetes.io/component": "proxy"}.items() <= api_peers[0]["podSelector"][
        "matchLabels"
    ].items()
    assert all("podSelector" in p or p["namespaceSelector"]["matchLabels"] == MONITORING for p in api_peers)
