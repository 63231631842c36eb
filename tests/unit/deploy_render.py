"""What the deployment tests share: where the artifacts are, the settings' names, and a renderer for
the subset of Kustomize the overlays use (`kubectl kustomize` renders the same where installed)."""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from app.core.config_doc import rows

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DATA = ROOT / "tests" / "data" / "deploy"
OVERLAYS = ["cpu-dev", "gpu-prod"]
K8S_VERSION = "1.30.0"  # one of the versions kubernetes-validate bundles
STAGES = 2
METRICS_PORT = "9100"


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def setting_names() -> set[str]:
    return {row.env.removeprefix("CONVEYOR_") for row in rows()}


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
BUILTIN_KINDS |= {"PodDisruptionBudget", "Namespace", "NetworkPolicy"}


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


# --- The overlays' Secrets, which are never committed ---------------------------------------------

SECRET_FILES = ("api.env", "webhooks.env", "redis.env", "flower.env")  # in overlays/<name>/secrets/


def _whsec() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def fresh_secrets() -> dict[str, str]:
    """Env files as an operator makes them from deploy/k8s/secrets.example/: random, real-looking."""
    digest = hashlib.sha256(secrets.token_urlsafe(32).encode()).hexdigest()
    return {
        "api.env": f'CONVEYOR_API_KEYS={{"{digest}":"tenant"}}\nCONVEYOR_JWT_KEY={secrets.token_hex(32)}\n'
        'CONVEYOR_JWT_ALGORITHMS=["HS256"]\nCONVEYOR_JWT_AUDIENCE=conveyor\n',
        "webhooks.env": f'CONVEYOR_WEBHOOK_SECRETS=["{_whsec()}"]\nCONVEYOR_WEBHOOK_MASTER_KEY={_whsec()}\n',
        "redis.env": f"REDIS_PASSWORD={secrets.token_hex(32)}\n",
        "flower.env": f"FLOWER_BASIC_AUTH=admin:{secrets.token_hex(16)}\n",
    }


# The values the repository once committed as examples (base/secrets.example.env, flower.example.env).
PUBLISHED_EXAMPLES = {
    "api.env": "CONVEYOR_API_KEYS="
    '{"22a60ff8c666ee7f81ede927b1adfb38922412b0bbd7162b99525a22607f603b":"example"}\n'
    "CONVEYOR_JWT_KEY=example-jwt-secret-change-me-at-least-32-bytes\n"
    'CONVEYOR_JWT_ALGORITHMS=["HS256"]\n',
    "webhooks.env": 'CONVEYOR_WEBHOOK_SECRETS=["whsec_ZXhhbXBsZS13ZWJob29rLXNlY3JldC1jaGFuZ2UtbWU="]\n',
    "redis.env": "REDIS_PASSWORD=change-me\n",
    "flower.env": "FLOWER_BASIC_AUTH=admin:change-me\n",
}


def with_secrets(overlay: str, files: dict[str, str]) -> Path:
    """A copy of deploy/k8s with `files` in the overlay's secrets/ directory; the overlay's path in it."""
    root = Path(tempfile.mkdtemp(prefix="conveyor-k8s-")) / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("secrets"))
    directory = root / "overlays" / overlay / "secrets"
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_text(text)
    return root / "overlays" / overlay


@functools.cache
def _render(overlay: str) -> list[dict[str, Any]]:
    return kustomize(with_secrets(overlay, fresh_secrets()))


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay rendered with fresh secrets (rendered once; a copy each call, callers may change it)."""
    return copy.deepcopy(_render(overlay))
