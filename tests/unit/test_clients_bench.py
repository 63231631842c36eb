"""bench/clients_tools.py: the load clients' command lines and environments, their JSON as rows, the table.

The fixtures in tests/data/clients/ are real outputs of guidellm 0.8.1 and aiperf 0.13.0 against a
Conveyor stack (SmolLM2, 128 → 64 tokens, concurrency 1, 4 requests), trimmed to the fields read here
and a few around them. No client runs and nothing touches the network.
"""

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package

from bench.clients_tools import (  # noqa: E402
    AIPERF,
    CLOSED_HUB,
    GUIDELLM,
    Row,
    Workload,
    aiperf_argv,
    aiperf_row,
    client_env,
    client_list,
    concurrency_list,
    guidellm_argv,
    guidellm_rows,
    report,
    table,
    tool_version,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "clients"
WORK = Workload(
    url="http://127.0.0.1:8000",
    model="SmolLM2-135M-Instruct",
    tokenizer=Path("/models/SmolLM2-135M-Instruct"),
    requests=16,
    prompt_tokens=128,
    output_tokens=64,
    timeout_s=300.0,
)


def fixture(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# ---------------------------------------------------------------- arguments


def test_concurrency_list_keeps_the_order_given_without_repeats():
    assert concurrency_list("1,8") == (1, 8)
    assert concurrency_list("8, 1,8,") == (8, 1)


@pytest.mark.parametrize("text", ["", "0", "1,-2", "one", "1.5"])
def test_concurrency_list_refuses_what_is_not_positive_integers(text):
    with pytest.raises(argparse.ArgumentTypeError):
        concurrency_list(text)


def test_client_list_accepts_known_clients_and_refuses_a_typo():
    assert client_list("aiperf, guidellm") == (AIPERF, GUIDELLM)
    with pytest.raises(argparse.ArgumentTypeError, match="guidellm"):
        client_list("guidelm")
    with pytest.raises(argparse.ArgumentTypeError):
        client_list(",")


# ---------------------------------------------------------------- command lines


def test_guidellm_gets_the_workload_in_its_kind_options():
    argv = guidellm_argv(Path("/venvs/guidellm"), WORK, 8, Path("/out/g.json"))
    assert argv[:2] == ["/venvs/guidellm/bin/guidellm", "run"]
    backend = option(argv, "--backend")
    assert "target=http://127.0.0.1:8000" in backend and "request_format=/v1/completions" in backend
    assert "model=SmolLM2-135M-Instruct" in backend
    assert option(argv, "--profile") == "kind=concurrent,streams=8"
    assert option(argv, "--data") == "kind=synthetic_text,prompt_tokens=128,output_tokens=64"
    assert option(argv, "--tokenizer") == "kind=huggingface_auto,model=/models/SmolLM2-135M-Instruct"
    assert option(argv, "--constraint") == "kind=max_requests,count=16"
    assert option(argv, "--output") == "kind=json,path=/out/g.json"


def test_aiperf_streams_completions_at_fixed_lengths_with_server_token_counts():
    argv = aiperf_argv(Path("/venvs/aiperf"), WORK, 1, Path("/out/a"))
    assert argv[:2] == ["/venvs/aiperf/bin/aiperf", "profile"]
    assert option(argv, "--endpoint-type") == "completions" and "--streaming" in argv
    assert (option(argv, "--isl"), option(argv, "--osl")) == ("128", "64")
    assert (option(argv, "--concurrency"), option(argv, "--request-count")) == ("1", "16")
    assert option(argv, "--extra-inputs") == "ignore_eos:true"
    assert option(argv, "--tokenizer") == "/models/SmolLM2-135M-Instruct"
    assert {"--use-server-token-count", "--no-gpu-telemetry", "--no-server-metrics"} <= set(argv)
    assert option(argv, "--artifact-dir") == "/out/a"


def test_no_client_can_reach_a_hub_and_aiperf_is_not_told_it_is_offline():
    base = {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    guidellm, aiperf = client_env(GUIDELLM, base), client_env(AIPERF, base)
    assert guidellm["HF_ENDPOINT"] == aiperf["HF_ENDPOINT"] == CLOSED_HUB
    assert guidellm["HF_HUB_OFFLINE"] == guidellm["TRANSFORMERS_OFFLINE"] == "1"
    # aiperf's offline mode reads the hub cache only and refuses a directory path as a tokenizer
    assert "HF_HUB_OFFLINE" not in aiperf and "TRANSFORMERS_OFFLINE" not in aiperf
    assert aiperf["PATH"] == "/bin" and base["HF_HUB_OFFLINE"] == "1"  # the caller's mapping untouched


# ---------------------------------------------------------------- parsing


def test_guidellm_rows_read_its_successful_requests_figures():
    [row] = guidellm_rows(fixture("guidellm"))
    assert (row.client, row.concurrency, row.ok, row.failed) == (GUIDELLM, 1, 4, 0)
    assert row.output_tokens_per_s == pytest.approx(6.13, abs=0.01)
    assert row.ttft_p50_ms == pytest.approx(166.95, abs=0.01)
    assert row.itl_p50_ms == pytest.approx(183.98, abs=0.01)
    assert row.latency_p50_s == pytest.approx(11.76, abs=0.01)


def test_guidellm_rows_count_errored_and_incomplete_requests_as_failed():
    doc = fixture("guidellm")
    doc["benchmarks"][0]["metrics"]["request_totals"].update(successful=2, errored=1, incomplete=1)
    second = copy.deepcopy(doc["benchmarks"][0])
    second["config"]["strategy"]["streams"] = 8
    doc["benchmarks"].append(second)
    rows = guidellm_rows(doc)
    assert [(r.concurrency, r.ok, r.failed) for r in rows] == [(1, 2, 2), (8, 2, 2)]


def test_guidellm_without_a_successful_request_has_no_figures():
    doc = fixture("guidellm")
    metrics = doc["benchmarks"][0]["metrics"]
    for name in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency"):
        metrics[name]["successful"] = None
    del metrics["output_tokens_per_second"]
    [row] = guidellm_rows(doc)
    assert (row.output_tokens_per_s, row.ttft_p50_ms, row.itl_p50_ms, row.latency_p50_s) == (None,) * 4


def test_aiperf_row_reads_its_profile_export():
    row = aiperf_row(fixture("aiperf"))
    assert (row.client, row.concurrency, row.ok, row.failed) == (AIPERF, 1, 4, 0)
    assert row.output_tokens_per_s == pytest.approx(0.908, abs=0.001)
    assert row.ttft_p50_ms == pytest.approx(3586.15, abs=0.01)
    assert row.itl_p50_ms == pytest.approx(1322.22, abs=0.01)
    assert row.latency_p50_s == pytest.approx(85.208, abs=0.001)  # ms in the file, seconds in the row


def test_aiperf_row_counts_errors_when_the_export_has_them():
    doc = fixture("aiperf")
    doc["error_request_count"] = {"unit": "requests", "avg": 3.0}
    del doc["time_to_first_token"]
    row = aiperf_row(doc)
    assert (row.ok, row.failed, row.ttft_p50_ms) == (4, 3, None)


def test_each_tool_names_its_own_version():
    assert tool_version(GUIDELLM, fixture("guidellm")) == "0.8.1"
    assert tool_version(AIPERF, fixture("aiperf")) == "0.13.0"
    assert tool_version(AIPERF, {}) is None


# ---------------------------------------------------------------- the table


def test_table_has_a_row_per_run_and_says_n_a_for_missing_figures():
    rows = [
        Row(GUIDELLM, 8, 16, 0, 61.04, 310.2, 118.26, 7.71),
        Row(AIPERF, 8, 15, 1, None, None, None, None),
    ]
    header, rule, first, second = table(rows)
    assert header.count("|") == rule.count("|") == first.count("|") == 8
    assert first == "| guidellm | 8 | 16 / 0 | 61.0 | 310 | 118.3 | 7.71 |"
    assert second == "| aiperf | 8 | 15 / 1 | n/a | n/a | n/a | n/a |"


def test_report_has_the_command_versions_load_average_and_failures():
    meta = {
        "command": ".venv/bin/python -m bench.clients --requests 16 --concurrency 1,8",
        "model": "SmolLM2-135M-Instruct",
        "target": "a stack",
        "prompt_tokens": 128,
        "output_tokens": 64,
        "requests": 16,
        "started": "2026-12-04 12:00 UTC",
        "commit": "abc1234",
        "cpus": 2,
        "versions": {GUIDELLM: "0.8.1", AIPERF: "0.13.0"},
        "settings": {"CONVEYOR_TORCH_THREADS": "1"},
        "load_average": {"before": 1.25, "after": 2.5},
        "wall_s": 600.0,
        "commands": ["guidellm run ..."],
    }
    row = Row(GUIDELLM, 1, 16, 0, 6.1, 167.0, 184.0, 11.76)
    text = report([row], meta, ["aiperf at concurrency 8: boom"])
    assert "`.venv/bin/python -m bench.clients --requests 16 --concurrency 1,8`" in text
    assert "guidellm 0.8.1, aiperf 0.13.0" in text
    assert "1.25 before, 2.50 after" in text
    assert "`CONVEYOR_TORCH_THREADS=1`" in text
    assert "- failure: aiperf at concurrency 8: boom" in text
    assert "| guidellm | 1 | 16 / 0 | 6.1 | 167 | 184.0 | 11.76 |" in text
    assert "guidellm run ..." in text
