"""`conveyor model add` / `model list` on local sources: the architecture checked before any weight
is touched, the manifest, exact names; and the CLI's refusals as a user sees them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny import make_tiny_model
from transformers import BertConfig
from typer.testing import CliRunner

from app.cli import cli
from app.core.config import Settings
from app.core.discovery import valid_model_name
from app.core.errors import InvalidRequest, UnsupportedModel
from app.core.gguf import read_gguf_header
from app.core.modelstore import Manifest, registered_dtype
from app.core.registry import add_model, check_gguf, list_models
from app.partitions.families import family_for, supported_model_types


def family(config: object) -> str:
    return family_for(config).name


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home")


def bert_dir(path: Path) -> Path:
    BertConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8
    ).save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"not read")
    return path


def test_a_directory_is_linked_file_by_file_and_registered(settings, tiny_dir):  # type: ignore[no-untyped-def]
    manifest = add_model(settings, str(tiny_dir), family=family, dtype="bfloat16", echo=lambda _: None)
    home = settings.model_home / "tiny"
    assert (home / "model.safetensors").is_symlink()
    assert (home / "model.safetensors").resolve() == (tiny_dir / "model.safetensors").resolve()
    assert not (tiny_dir / "conveyor.json").exists(), "the user's directory is left as it was"
    assert Manifest.read(home) == manifest
    assert (manifest.family, manifest.dtype, manifest.context_length) == ("llama", "bfloat16", 512)
    assert manifest.parameters == 164_672  # the tiny Llama's, read from the safetensors header
    assert registered_dtype(home) == "bfloat16"
    assert settings.model_path("tiny") == home and "tiny" in settings.model_names()


def test_copy_and_a_chosen_name(settings, tiny_dir):  # type: ignore[no-untyped-def]
    add_model(settings, str(tiny_dir), family=family, name="my-model.v2", copy=True, echo=lambda _: None)
    home = settings.model_home / "my-model.v2"
    assert not (home / "model.safetensors").is_symlink() and (home / "model.safetensors").is_file()
    assert registered_dtype(home) == "auto"
    assert registered_dtype(tiny_dir) is None  # no manifest: nothing recorded


def test_a_name_already_taken_is_refused_unless_replaced(settings, tiny_dir):  # type: ignore[no-untyped-def]
    add_model(settings, str(tiny_dir), family=family, echo=lambda _: None)
    with pytest.raises(InvalidRequest, match="--replace"):
        add_model(settings, str(tiny_dir), family=family, echo=lambda _: None)
    add_model(settings, str(tiny_dir), family=family, dtype="float16", replace=True, echo=lambda _: None)
    assert registered_dtype(settings.model_home / "tiny") == "float16"


def test_an_unsupported_architecture_is_refused_before_anything_is_written(settings, tmp_path):  # type: ignore[no-untyped-def]
    source = bert_dir(tmp_path / "bert")
    with pytest.raises(UnsupportedModel) as refused:
        add_model(settings, str(source), family=family, echo=lambda _: None)
    assert "'bert'" in refused.value.message and "llama" in refused.value.message
    assert not settings.model_home.exists() or not any(settings.model_home.iterdir())


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "x..y", "", "-x", "a" * 129, "a\\b", "é"])
def test_names_that_could_be_paths_are_refused(settings, tiny_dir, name):  # type: ignore[no-untyped-def]
    assert not valid_model_name(name)
    with pytest.raises(InvalidRequest, match="cannot name a model"):
        add_model(settings, str(tiny_dir), family=family, name=name, echo=lambda _: None)


def test_a_directory_without_its_weights_or_tokenizer_is_refused(settings, tiny_dir, tmp_path):  # type: ignore[no-untyped-def]
    no_weights = shutil.copytree(tiny_dir, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(InvalidRequest, match="safetensors"):
        add_model(settings, str(no_weights), family=family, echo=lambda _: None)
    no_tokenizer = shutil.copytree(tiny_dir, tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(InvalidRequest, match="tokenizer"):
        add_model(settings, str(no_tokenizer), family=family, echo=lambda _: None)


def test_list_says_which_models_can_be_served_and_why_not(settings, tiny_dir, tmp_path):  # type: ignore[no-untyped-def]
    add_model(settings, str(tiny_dir), family=family, echo=lambda _: None)
    bert_dir(settings.model_home / "by-hand")  # put in the home without `model add`
    broken = shutil.copytree(tiny_dir, settings.model_home / "broken")
    (broken / "model.safetensors").unlink()
    (settings.model_home / ".partial-leftover").mkdir()
    configured = settings.model_copy(update={"models": {"elsewhere": tmp_path / "gone"}})
    rows = {e.name: e for e in list_models(configured, family=family)}
    assert set(rows) == {"tiny", "by-hand", "broken", "elsewhere"}
    assert rows["tiny"].problem is None and rows["tiny"].parameters == 164_672
    assert rows["by-hand"].unsupported and rows["by-hand"].problem == "unsupported architecture 'bert'"
    assert rows["broken"].problem == "missing weights: model.safetensors"
    assert "does not exist" in (rows["elsewhere"].problem or "")


def test_a_sharded_checkpoint_counts_every_shard(settings, tiny_dir, tmp_path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(sharded, max_shard_size="200KB")
    for f in tiny_dir.glob("tokenizer*"):
        shutil.copy(f, sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    manifest = add_model(settings, str(sharded), family=family, echo=lambda _: None)
    assert manifest.parameters == 164_672
    shard = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    (sharded / sorted(set(shard.values()))[-1]).unlink()
    rows = {e.name: e for e in list_models(settings, family=family)}
    assert (rows["sharded"].problem or "").startswith("missing weights: model-")


def write_gguf(path: Path, architecture: str, name: str = "test model") -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_block_count(2)
    writer.add_token_list([f"t{i}" for i in range(300)])  # an array before nothing we need
    writer.add_token_scores([0.0] * 300)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_gguf_architecture_is_read_from_the_header(tmp_path):  # type: ignore[no-untyped-def]
    header = read_gguf_header(write_gguf(tmp_path / "m.gguf", "gemma3", "Gemma 3 270m"))
    assert (header.architecture, header.name, header.block_count) == ("gemma3", "Gemma 3 270m", 2)
    assert check_gguf(tmp_path / "m.gguf", family) == "gemma3"  # llama.cpp's gemma3 is gemma3_text


def test_an_unsupported_gguf_is_refused_before_conversion(settings, tmp_path):  # type: ignore[no-untyped-def]
    gguf = write_gguf(tmp_path / "rwkv.gguf", "rwkv6")
    with pytest.raises(UnsupportedModel, match="'rwkv6'"):
        add_model(settings, str(gguf), family=family, echo=lambda _: None)
    assert not (settings.model_home / "rwkv").exists()


def test_the_cli_refuses_with_the_architecture_and_the_supported_list(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(cli, ["model", "add", str(bert_dir(tmp_path / "bert"))])
    assert result.exit_code == 2
    assert "'bert'" in result.output and ", ".join(supported_model_types()) in result.output
    result = CliRunner().invoke(cli, ["model", "add", str(tmp_path / "nowhere.gguf")])
    assert result.exit_code == 2 and "no such model directory or GGUF file" in result.output
    result = CliRunner().invoke(cli, ["model", "add", str(tmp_path / "bert"), "--dtype", "int8"])
    assert result.exit_code == 2 and "float16" in result.output


def test_the_cli_lists_the_models(tmp_path, tiny_dir, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    assert CliRunner().invoke(cli, ["model", "add", str(tiny_dir), "--dtype", "float32"]).exit_code == 0
    bert_dir(tmp_path / "home" / "models" / "by-hand")
    lines = CliRunner().invoke(cli, ["model", "list"]).output.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "PARAMS", "DTYPE", "CONTEXT", "SERVABLE"]
    assert lines[1].split() == [
        "by-hand",
        "-",
        "-",
        "-",
        "512",
        "no:",
        "unsupported",
        "architecture",
        "'bert'",
    ]
    assert lines[2].split() == ["tiny", "llama", "164.7K", "float32", "512", "yes"]
    assert lines[3].startswith("supported model types: ")


def test_up_serves_the_named_models_once_each_and_refuses_unknown_ones(settings, tiny_dir):  # type: ignore[no-untyped-def]
    import typer

    from app.cli_up import served_models

    add_model(settings, str(tiny_dir), family=family, echo=lambda _: None)
    configured = settings.model_copy(update={"models": {"other": tiny_dir}, "default_model": "other"})
    assert served_models(configured, []) == ["other"]
    assert served_models(configured, ["tiny", "other", "tiny"]) == ["tiny", "other"]
    with pytest.raises(typer.BadParameter, match="conveyor model add SOURCE --name nope"):
        served_models(configured, ["tiny", "nope"])
    with pytest.raises(typer.BadParameter):
        served_models(configured, ["tiny/"])
