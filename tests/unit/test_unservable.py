"""Models of a supported family that the stages cannot serve are refused, each with its reason, wherever
they are met: `model add`, the stage worker (one line on stderr and an exit `conveyor up` does not
restart) and the supervisor (the rest of the stack goes on). A weights file that is not safetensors is
a refusal that says so, never a MemoryError."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from tiny import make_tiny_model
from transformers import AutoConfig
from typer.testing import CliRunner
from unservable import bidirectional, headless, lfs_pointer

from app.cli import cli
from app.core import modelstore
from app.core.config import Settings
from app.core.errors import UnsupportedModel
from app.core.registry import add_model, list_models
from app.launcher import UNSERVABLE_EXIT, Child, Supervisor
from app.partitions.families import family_for
from app.partitions.layers import LayerRange, StagePartition
from app.partitions.loading import check_servable


def test_bidirectional_gemma3_is_refused(tmp_path: Path) -> None:
    path = bidirectional(tmp_path / "embeddinggemma")
    with pytest.raises(UnsupportedModel, match="bidirectional attention"):
        check_servable(path)
    with pytest.raises(UnsupportedModel, match="bidirectional attention"):
        StagePartition.load(path)


@pytest.mark.parametrize("stage", [0, 1])
def test_an_untied_checkpoint_without_an_lm_head_is_refused(tmp_path: Path, stage: int) -> None:
    """Its head is not the embedding: loading the embedding as its head would generate garbage."""
    path = headless(tmp_path / "reward")
    with pytest.raises(UnsupportedModel, match="no LM head"):
        check_servable(path)
    with pytest.raises(UnsupportedModel, match="no LM head"):
        StagePartition.load(path, LayerRange.even_split(2, 2, stage) if stage else LayerRange(0, 2))


def test_a_classification_or_reward_head_is_refused_from_the_config(tmp_path: Path) -> None:
    path = headless(tmp_path / "rm", architecture="LlamaForSequenceClassification")
    with pytest.raises(UnsupportedModel, match="LlamaForSequenceClassification"):
        family_for(AutoConfig.from_pretrained(path))
    settings = Settings(home=tmp_path / "home")
    with pytest.raises(UnsupportedModel, match="scores or labels text"):
        add_model(settings, str(path), family=lambda c: family_for(c).name, echo=lambda _: None)
    assert not (settings.model_home / "rm").exists()


def test_a_git_lfs_pointer_is_refused_as_such(tmp_path: Path) -> None:
    path = lfs_pointer(tmp_path / "pointer")
    for read in (modelstore.count_parameters, check_servable, StagePartition.load):
        with pytest.raises(UnsupportedModel, match="git-lfs pointer"):
            read(path)  # type: ignore[operator]
    truncated = make_tiny_model(tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnsupportedModel, match="truncated"):
        check_servable(truncated)


def test_model_add_refuses_a_git_lfs_pointer(tmp_path: Path) -> None:
    path = lfs_pointer(tmp_path / "pointer")
    settings = Settings(home=tmp_path / "home")
    with pytest.raises(UnsupportedModel, match="git-lfs pointer"):
        add_model(settings, str(path), family=lambda c: family_for(c).name, echo=lambda _: None)


def test_a_worker_given_an_unservable_model_exits_with_one_line(tmp_path: Path) -> None:
    path = headless(tmp_path / "reward")
    env = {"CONVEYOR_MODELS": json.dumps({"reward": str(path)}), "CONVEYOR_HOME": str(tmp_path / "home")}
    result = CliRunner().invoke(cli, ["worker", "--model", "reward", "--stages", "1"], env=env)
    assert result.exit_code == UNSERVABLE_EXIT, result.output
    assert result.stderr.strip().splitlines() == [
        f"conveyor: model 'reward' cannot be served: {_message(path)}"
    ]
    assert "Traceback" not in result.output


def _message(path: Path) -> str:
    try:
        check_servable(path)
    except UnsupportedModel as exc:
        return exc.message
    raise AssertionError("served")


def test_the_supervisor_leaves_an_unservable_worker_down_and_keeps_the_rest() -> None:
    """Exit UNSERVABLE_EXIT: reported once, not restarted, and the stack is not brought down; another
    child that fails keeps its restarts."""
    out = io.StringIO()
    supervisor = Supervisor({}, out=out)
    unservable = Child("bad:stage0", [sys.executable, "-c", f"raise SystemExit({UNSERVABLE_EXIT})"])
    serving = Child("good:stage0", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        supervisor.add(unservable)
        supervisor.add(serving)
        assert unservable.process is not None
        unservable.process.wait(30)
        for _ in range(3):
            assert supervisor._check() is None
        assert unservable.given_up and not unservable.restarts
        assert serving.process is not None and serving.process.poll() is None
        said = out.getvalue()
        assert said.count(f"bad:stage0 exited with code {UNSERVABLE_EXIT}") == 1
        assert "bad:stage0 cannot serve its model" in said and "restarting bad:stage0" not in said
    finally:
        supervisor.shutdown()


def test_model_add_refuses_a_checkpoint_without_its_head(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    with pytest.raises(UnsupportedModel, match="no LM head"):
        add_model(settings, str(headless(tmp_path / "reward")), family=lambda c: family_for(c).name)
    assert not (settings.model_home / "reward").exists()


def test_model_list_says_why_each_unservable_model_is_not_served(tmp_path: Path) -> None:
    models = {
        "pointer": lfs_pointer(tmp_path / "pointer"),
        "reward": headless(tmp_path / "reward"),
        "embeddinggemma": bidirectional(tmp_path / "embeddinggemma"),
        "tiny": make_tiny_model(tmp_path / "tiny"),
    }
    settings = Settings(home=tmp_path / "home", models={n: str(p) for n, p in models.items()})
    problems = {e.name: e.problem for e in list_models(settings, family=lambda c: family_for(c).name)}
    assert problems["tiny"] is None
    assert "git-lfs pointer" in str(problems["pointer"])
    assert "no LM head" in str(problems["reward"])
    assert "bidirectional attention" in str(problems["embeddinggemma"])
