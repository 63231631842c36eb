"""The rest of the deployment, checked offline: docker-compose.yml against the Compose specification,
Prometheus rules through a real PromQL parser (promtool too where installed), the Grafana dashboard,
the Dockerfiles."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser
import pytest
import yaml
from deploy_render import (
    DATA,
    DEPLOY,
    METRICS_PORT,
    OVERLAYS,
    ROOT,
    STAGES,
    pod_specs,
    render,
    setting_names,
)
from typer.main import get_command

from app.api.service import SYNC_TIMEOUT_S
from app.cli import cli
from app.core.config import Settings

# the deployment manifests: `make test-deploy`, out of the default gate
pytestmark = pytest.mark.deploy

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
    "conveyor_stage_unhealthy",
    "conveyor_prefix_cache_tokens_total",
    "conveyor_prefix_cache_bytes",
    "up",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_start_time_seconds",
}
# redis_exporter's, for the Redis memory alert (the `redis` scrape job).
EXPORTER_METRICS = {"redis_memory_used_bytes", "redis_memory_max_bytes"}
REQUIRED_ALERTS = {
    "HighPartitionLatency",
    "HighEndToEndLatencyP99",
    "HighErrorRate",
    "JobFailureRate",
    "QueueDepthGrowing",
    "CircuitBreakerOpen",
    "WorkerMissing",
    "StageReplicaUnhealthy",
    "RedisMemoryHigh",
}


# --- docker-compose ------------------------------------------------------------------------------

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CONVEYOR_SERVICES = {n for n, s in COMPOSE["services"].items() if s.get("image", "").startswith("conveyor")}


# What an operator must set (compose's `${VAR:?message}` refuses to start without it).
REQUIRED = {
    "REDIS_PASSWORD": "0123456789abcdef0123456789abcdef",
    "CONVEYOR_WEBHOOK_SECRETS": '["whsec_c2VjcmV0LW9mLXRoZS1jb21wb3NlLXRlc3RzLTMyYg=="]',
    "CONVEYOR_WEBHOOK_MASTER_KEY": "whsec_bWFzdGVyLWtleS1vZi10aGUtY29tcG9zZS10ZXN0cy0z",
    "FLOWER_PASSWORD": "flower-password-of-the-tests",
    "GRAFANA_ADMIN_PASSWORD": "grafana-password-of-the-tests",
}


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set in the environment, `${VAR:?message}` with what an
    operator sets (REQUIRED), and `$$` for a literal `$`."""
    value = re.sub(r"(?<!\$)\$\{(\w+):\?[^}]*\}", lambda m: REQUIRED[m.group(1)], value)
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
    assert "--basic-auth" in services["flower"]["command"][-1]
    assert "127.0.0.1:5555:5555" in services["flower"]["ports"]
    redis = services["redis"]
    assert "redis-cli ping" in redis["healthcheck"]["test"][-1]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert "noeviction" in redis["command"]


def test_compose_redis_requires_the_password_every_client_sends():
    services = COMPOSE["services"]
    redis = services["redis"]
    password = interpolate(redis["command"][redis["command"].index("--requirepass") + 1])
    assert password == REQUIRED["REDIS_PASSWORD"]  # required: compose refuses to start without it
    assert interpolate(redis["environment"]["REDISCLI_AUTH"]) == password  # the health check's login
    for name in CONVEYOR_SERVICES:
        url = interpolate(services[name]["environment"]["REDIS_URL"])
        assert url == f"redis://:{password}@redis:6379/0", name
    assert "--broker" not in services["flower"]["command"][-1]  # the URL stays off the command line


def published(port: str | dict[str, Any]) -> tuple[str | None, str]:
    """(host address, the rest) of a `ports` entry, short ("127.0.0.1:8000:8000") or long syntax."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port.get("published", ""))
    parts = str(port).rsplit(":", 2)
    return (parts[0], ":".join(parts[1:])) if len(parts) == 3 else (None, str(port))


def test_compose_publishes_every_port_on_loopback_only():
    ports = [(name, p) for name, s in COMPOSE["services"].items() for p in s.get("ports", [])]
    assert {name for name, _ in ports} >= {"proxy", "flower", "prometheus", "grafana"}
    assert "api" not in {name for name, _ in ports}  # clients come through the proxy
    for name, port in ports:
        host, _ = published(port)
        assert host == "127.0.0.1", f"{name} publishes {port!r} beyond this host"
    assert published("8000:8000")[0] is None and published({"host_ip": "0.0.0.0"})[0] == "0.0.0.0"


NGINX = DEPLOY / "nginx" / "nginx.conf"


def nginx_directives(text: str) -> dict[str, list[str]]:
    """Every simple directive of an nginx configuration, by name: its arguments as written (blocks
    flattened; a `map` block's entries included). Refuses unbalanced braces and a statement
    without its `;`."""
    found: dict[str, list[str]] = {}
    depth = 0
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line == "}":
            depth -= 1
            assert depth >= 0, "unbalanced braces"
            continue
        if line.endswith("{"):
            depth += 1
            continue
        assert line.endswith(";"), f"no ';' after {line!r}"
        name, _, args = line[:-1].partition(" ")
        found.setdefault(name, []).append(args.strip())
    assert depth == 0, "unbalanced braces"
    return found


def test_the_proxy_is_the_apis_front_with_deadlines_and_per_client_caps():
    services = COMPOSE["services"]
    proxy = services["proxy"]
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in proxy["volumes"]
    assert proxy["ports"] == ["127.0.0.1:8000:8080"] and proxy["read_only"] is True
    conf = nginx_directives(NGINX.read_text())
    assert conf["listen"] == ["8080"] and conf["server"] == ["api:8000"]  # the api service, its port
    seconds = {
        name: int(conf[name][0].removesuffix("s"))
        for name in ("client_header_timeout", "client_body_timeout")
    }
    assert all(0 < s <= 30 for s in seconds.values()), seconds
    assert conf["client_max_body_size"] == ["1m"] and Settings().max_body_bytes == 1024 * 1024
    assert conf["limit_conn"][0].startswith("per_client_conn ") and conf["limit_req"]
    assert int(conf["proxy_read_timeout"][0].removesuffix("s")) > SYNC_TIMEOUT_S
    assert conf["proxy_buffering"] == ["off"]  # SSE streams go out as written
    assert conf["pid"] == ["/tmp/nginx.pid"]  # a read-only root filesystem: everything under /tmp


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_nginx_accepts_the_proxys_configuration(tmp_path: Path):
    conf = tmp_path / "nginx.conf"  # `api` resolves only inside the deployment
    conf.write_text(NGINX.read_text().replace("server api:8000;", "server 127.0.0.1:8000;"))
    checked = subprocess.run(["nginx", "-t", "-c", str(conf)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_compose_dashboards_need_passwords_and_prometheus_takes_no_admin_calls():
    services = COMPOSE["services"]
    grafana = services["grafana"]["environment"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", grafana["GF_SECURITY_ADMIN_PASSWORD"])
    flower = services["flower"]
    assert "${FLOWER_PASSWORD:?" in flower["environment"]["FLOWER_LOGIN"]
    assert '--basic-auth="$$FLOWER_LOGIN"' in flower["command"][-1]
    assert not any("lifecycle" in arg or "admin-api" in arg for arg in services["prometheus"]["command"])


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
            expected = {"api": "8000", "flower": "5555", "redis-exporter": "9121"}.get(host, METRICS_PORT)
            assert port == expected, target
            scraped.add(host)
    assert scraped == CONVEYOR_SERVICES | {"redis-exporter"}
    assert services["redis-exporter"]["environment"]["REDIS_ADDR"] == "redis://redis:6379"
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
        known = KNOWN_METRICS | EXPORTER_METRICS
        assert metrics <= known, f"{name}: unknown metrics {metrics - known}"
    seed = (
        "sum by (partition_id) (rate(conveyor_partition_latency_seconds_sum[5m]))"
        " / sum by (partition_id) (rate(conveyor_partition_latency_seconds_count[5m])) > 0.5"
    )
    assert str(promql_parser.parse(ALERTS["HighPartitionLatency"]["expr"])) == str(promql_parser.parse(seed))
    assert ALERTS["HighPartitionLatency"]["for"] == ALERTS["HighEndToEndLatencyP99"]["for"] == "5m"
    assert query_facts(ALERTS["HighEndToEndLatencyP99"]["expr"])[2] == {0.99}
    assert ALERTS["CircuitBreakerOpen"]["for"] == "1m" and ALERTS["WorkerMissing"]["for"] == "2m"
    assert query_facts(ALERTS["RedisMemoryHigh"]["expr"])[0] == EXPORTER_METRICS
    assert ALERTS["RedisMemoryHigh"]["for"] == "5m"
    redis = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "--maxmemory-policy noeviction" in redis and "--maxmemory 1gb" in redis  # the alert's divisor


def test_rule_jobs_match_the_scrape_configs():
    compose_jobs = {
        j["job_name"]
        for j in yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())["scrape_configs"]
    }
    components = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in render(OVERLAYS[0])
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


def promtool_config_ok(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(path)], capture_output=True, text=True
    )


def promtool_has_kubernetes_sd(tmp: Path) -> bool:
    """Whether this promtool knows `kubernetes_sd_configs`: some distribution builds (Debian's
    `prometheus` package) leave Kubernetes service discovery out, and reject any config that uses it."""
    probe = tmp / "k8s-sd-probe.yml"
    probe.write_text("scrape_configs:\n  - job_name: probe\n    kubernetes_sd_configs:\n      - role: pod\n")
    return promtool_config_ok(probe).returncode == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_rules_and_configs(tmp_path: Path):
    prom = DEPLOY / "prometheus"
    subprocess.run(["promtool", "check", "rules", str(prom / "rules.yml")], check=True)
    checked = promtool_config_ok(prom / "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if not promtool_has_kubernetes_sd(tmp_path):
        pytest.skip(
            "rules and prometheus.yml pass; prometheus-k8s.yml not checked: this promtool is built "
            "without Kubernetes service discovery and rejects kubernetes_sd_configs"
        )
    checked = promtool_config_ok(prom / "prometheus-k8s.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


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
