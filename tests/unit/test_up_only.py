"""`conveyor up --only`: which processes a host starts, and what it refuses before starting any."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.core.config import Settings
from app.stack import Only, Part, processes, torch_threads

ME = ["python", "-m", "app.cli"]


def names(
    only: list[str], *, stages: int = 2, replicas: int = 1, models: tuple[str, ...] = ("tiny",)
) -> list[str]:
    settings = Settings(stages=stages, replicas=replicas, embedding_stages=2)
    return [child.name for child in Only.parse(only).pick(processes(settings, list(models), ME), ["api"])]


def test_without_only_every_process_starts():
    assert names([]) == ["batcher", "webhooks", "callbacks", "stage0", "stage1", "embed0", "embed1"]
    assert Only.parse([]).wants(Part("api")) and Only.parse([]).wants(Part("redis"))


def test_a_host_can_run_one_stage_or_the_front_of_the_pipeline():
    assert names(["stage:1"]) == ["stage1"]
    assert names(["stage:1"], replicas=2) == ["stage1.0", "stage1.1"]
    front = Only.parse(["api,batcher", "stage:0"])
    assert front.wants(Part("api")) and not front.wants(Part("redis")) and not front.wants(Part("flower"))
    assert names(["api,batcher", "stage:0"]) == ["batcher", "stage0"]
    assert names(["stages"]) == ["stage0", "stage1"]
    assert names(["embeddings", "webhooks"]) == ["webhooks", "embed0", "embed1"]
    assert names(["embed:1"]) == ["embed1"]


def test_a_stage_of_one_model_among_several():
    assert names(["stage:b:0"], models=("a", "b")) == ["b:stage0"]
    assert names(["stage:0"], models=("a", "b")) == ["a:stage0", "b:stage0"]


@pytest.mark.parametrize(
    ("only", "says"),
    [
        (["stage:2"], "starts no such process"),  # two stages: 0 and 1
        (["stage:other:0"], "starts no such process"),
        (["flower"], "starts no such process"),  # not offered to pick from here
        (["stage1"], "not a process name"),
        (["stage:-1"], "not a process name"),
        (["api,workers"], "not a process name"),
    ],
)
def test_a_name_that_names_nothing_is_refused(only: list[str], says: str):
    with pytest.raises(ValueError, match=says):
        names(only)


def test_leaving_redis_out_requires_a_shared_redis(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("REDIS_URL", raising=False)
    result = CliRunner().invoke(
        cli, ["up", "--only", "stage:0"], env={"CONVEYOR_HOME": str(tmp_path), "COLUMNS": "300"}
    )
    assert result.exit_code == 2
    assert "REDIS_URL" in result.output


def test_naming_the_embedded_redis_with_redis_url_set_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    env = {"CONVEYOR_HOME": str(tmp_path), "REDIS_URL": "redis://127.0.0.1:1/0", "COLUMNS": "300"}
    result = CliRunner().invoke(cli, ["up", "--only", "redis,api"], env=env)
    assert result.exit_code == 2
    assert "REDIS_URL replaces" in result.output


def test_the_stack_leaves_one_core_to_the_api_and_splits_the_rest_among_its_workers():
    assert torch_threads(2, 1, 2) == (1, 1)  # this project's 2-core machine: one thread each
    assert torch_threads(1, 1, 0) == (1, 1)
    assert torch_threads(16, 1, 2) == (15, 5)
    assert torch_threads(16, 4, 0) == (3, 3)  # two models in two stages


def test_each_worker_is_given_its_share_unless_the_operator_chose():
    settings = Settings(stages=2, replicas=1, embedding_stages=1)
    children = {child.name: child for _, child in processes(settings, ["tiny"], ME, cores=9)}
    # a stage worker keeps its share and widens while the other cores idle; an embeddings worker's is fixed
    assert children["stage0"].argv[-2:] == children["stage1"].argv[-2:] == ["--share", "4"]
    assert children["stage0"].env == {}
    assert children["embed0"].env == {"CONVEYOR_TORCH_THREADS": "2"}
    assert children["batcher"].env == {}
    chosen = Settings(stages=2, replicas=2, embedding_stages=1, torch_threads=3)
    picked = [child for _, child in processes(chosen, ["tiny"], ME, cores=9)]
    assert all(not child.env and "--share" not in child.argv for child in picked)


def test_replicas_of_a_stage_each_get_one_share():
    settings = Settings(stages=1, replicas=2, embedding_stages=0)
    argvs = [child.argv for part, child in processes(settings, ["tiny"], ME, cores=9) if part.kind == "stage"]
    assert [argv.count("--share") for argv in argvs] == [1, 1]


def test_a_host_running_part_of_the_stack_shares_its_cores_among_its_own_workers():
    settings = Settings(stages=2, replicas=1, embedding_stages=1)
    here = Only.parse(["stage:1"])
    argv = {child.name: child.argv for _, child in processes(settings, ["tiny"], ME, here, cores=9)}
    assert argv["stage1"][-2:] == ["--share", "8"]  # the one worker here: every core but one
    assert "--share" not in argv["stage0"]  # another host's: not started here


@pytest.mark.parametrize(
    ("port", "flag", "runs_on"),
    [(None, None, 5555), ("7000", None, 7000), ("0", None, 0), ("7000", False, 0), ("0", True, 5555)],
)
def test_no_flower_is_flower_port_zero_for_the_stack_and_its_workers(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch, port, flag, runs_on
):
    from app.cli_up import plan_stack

    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    if port is None:
        monkeypatch.delenv("CONVEYOR_FLOWER_PORT", raising=False)
    else:
        monkeypatch.setenv("CONVEYOR_FLOWER_PORT", port)
    stack = plan_stack(
        stages=None, replicas=None, plan=None, flower=flag, models=[], only=[], certfile=None, keyfile=None
    )
    assert stack.settings.flower_port == runs_on and stack.run_flower == bool(runs_on)
    assert stack.env["CONVEYOR_FLOWER_PORT"] == str(runs_on)  # the workers send task events only to a Flower
