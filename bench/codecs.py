"""Stage-message codecs measured: round-trip throughput, bytes on the wire, and error, per codec and size.

    .venv/bin/python -m bench.codecs [--activations auto|smollm2|gaussian] [--budget-s 2]

(Run it as a module: `python bench/codecs.py` would shadow the standard library's `codecs`.)

Tensors: a decode step's hidden states [8, 1, 576] and a prefill's [8, 128, 576], float32. With
SmolLM2-135M pulled (`conveyor model pull`), they are its real residual stream after layer 15 of 30
(where a two-stage pipeline cuts it), which carries SmolLM2's massive activations (|x| up to ~3e4);
otherwise standard Gaussian noise, the worst case for zfp (nothing to predict). One round trip is
what a hop pays: `CodecSpec.encode` -> `msgpack.packb` | `msgpack.unpackb` -> `decode_tensor`; the
median over repetitions is reported. "wire bytes" is the msgpack-packed wire dict.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from app.partitions.codecs import CodecSpec, decode_tensor
from bench.report import git_commit, write_results
from bench.systems import ROOT, say

CUT_LAYER = 15  # SmolLM2-135M has 30 layers; a two-stage pipeline sends the output of layer 15
SMOLLM2 = "SmolLM2-135M-Instruct"
DECODE_SHAPE = (8, 1, 576)  # [B, S, D]: one decode step of a batch of 8
PREFILL_SHAPE = (8, 128, 576)  # [B, S, D]: a batch of 8 prompts of 128 tokens
MIN_REPS, MAX_REPS, WARMUP = 10, 2000, 3

CASES: list[tuple[str, CodecSpec]] = [
    ("raw", CodecSpec()),
    ("arrow", CodecSpec("arrow")),
    ("arrow+zstd", CodecSpec("arrow+zstd")),
    ("arrow+lz4", CodecSpec("arrow+lz4")),
    ("zfp tolerance=1e-3", CodecSpec("zfp", tolerance=1e-3)),
    ("zfp tolerance=1e-2", CodecSpec("zfp", tolerance=1e-2)),
    ("raw + float16 transport", CodecSpec(transport_dtype="float16")),
    ("raw + bfloat16 transport", CodecSpec(transport_dtype="bfloat16")),
    ("arrow+zstd + bfloat16 transport", CodecSpec("arrow+zstd", transport_dtype="bfloat16")),
    ("arrow+lz4 + bfloat16 transport", CodecSpec("arrow+lz4", transport_dtype="bfloat16")),
]


@dataclass(frozen=True)
class Row:
    tensor: str
    case: str
    nbytes: int  # the tensor's own bytes
    wire_bytes: int  # msgpack-packed wire dict
    encode_us: float
    decode_us: float
    round_trip_us: float
    max_abs_err: float
    reps: int

    def gbps(self, us: float | None = None) -> float:
        """The tensor's own bytes per second through `us` (default: the whole round trip), in GB/s."""
        return self.nbytes / ((us or self.round_trip_us) * 1e-6) / 1e9


def smollm2_hidden(path: Path) -> torch.Tensor:
    """[8, 128, 576]: SmolLM2's hidden states after layer CUT_LAYER over 8 windows of README text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.model.layers = model.model.layers[:CUT_LAYER]  # the rest is the next stage's
    batch, seq, _ = PREFILL_SHAPE
    ids = tokenizer((ROOT / "README.md").read_text()).input_ids
    ids = (ids * (batch * seq // len(ids) + 1))[: batch * seq]
    captured: list[torch.Tensor] = []
    model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        model(torch.tensor(ids).reshape(batch, seq))
    return captured[0].detach().contiguous()


def activations(source: str) -> tuple[torch.Tensor, str]:
    """The prefill-sized tensor and a line saying what it is."""
    from app.core.config import Settings

    path = Settings().model_path(SMOLLM2)
    if source == "smollm2" and path is None:
        raise SystemExit(f"{SMOLLM2} is not pulled; run `conveyor model pull` or use --activations gaussian")
    if source != "gaussian" and path is not None:
        say(f"computing {SMOLLM2} hidden states after layer {CUT_LAYER}")
        return smollm2_hidden(path), f"{SMOLLM2} residual stream after layer {CUT_LAYER} of 30"
    generator = torch.Generator().manual_seed(0)
    return torch.randn(PREFILL_SHAPE, generator=generator), "standard Gaussian noise (seed 0)"


def measure(name: str, case: str, spec: CodecSpec, x: torch.Tensor, budget_s: float) -> Row:
    encode, decode = [], []
    wire = msgpack.packb(spec.encode(x))
    deadline = time.perf_counter() + budget_s
    for i in range(MAX_REPS + WARMUP):
        t0 = time.perf_counter()
        wire = msgpack.packb(spec.encode(x))
        t1 = time.perf_counter()
        y = decode_tensor(msgpack.unpackb(wire))
        t2 = time.perf_counter()
        if i >= WARMUP:
            encode.append(t1 - t0)
            decode.append(t2 - t1)
        if len(encode) >= MIN_REPS and t2 > deadline:
            break
    round_trip = [e + d for e, d in zip(encode, decode, strict=True)]
    return Row(
        tensor=name,
        case=case,
        nbytes=x.numel() * x.element_size(),
        wire_bytes=len(wire),
        encode_us=statistics.median(encode) * 1e6,
        decode_us=statistics.median(decode) * 1e6,
        round_trip_us=statistics.median(round_trip) * 1e6,
        max_abs_err=float((y.double() - x.double()).abs().max()),
        reps=len(encode),
    )


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| tensor | codec | wire bytes | vs raw | encode µs | decode µs | encode GB/s | decode GB/s "
        "| round trip GB/s | max abs error | reps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    raw = {r.tensor: r.wire_bytes for r in rows if r.case == "raw"}
    for r in rows:
        lines.append(
            f"| {r.tensor} | {r.case} | {r.wire_bytes:,} | {r.wire_bytes / raw[r.tensor]:.2f} "
            f"| {r.encode_us:,.0f} | {r.decode_us:,.0f} | {r.gbps(r.encode_us):.2f} "
            f"| {r.gbps(r.decode_us):.2f} | {r.gbps():.2f} | {r.max_abs_err:.3g} | {r.reps} |"
        )
    return lines


def report(rows: list[Row], source: str, x: torch.Tensor, command: str) -> str:
    load = os.getloadavg()
    return "\n".join(
        [
            "# Stage-message codecs",
            "",
            f"Made by `{command}`.",
            "",
            f"Tensors: {source}; prefill-sized: max |x| {float(x.abs().max()):.4g}, "
            f"std {float(x.std()):.4g}.",
            "Round trip = encode + msgpack pack + unpack + decode, median over `reps`; encode is "
            "`CodecSpec.encode` + pack, decode is unpack + `decode_tensor`; GB/s counts the tensor's own "
            "float32 bytes. zfp tolerance is an absolute error bound. arrow+zstd and arrow+lz4 are "
            'byte-exact: their "vs raw" is the compression ratio on these activations.',
            f"Commit {git_commit()}, torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"{os.cpu_count()} CPUs, load average {load[0]:.2f}.",
            "",
            *table(rows),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activations", choices=["auto", "smollm2", "gaussian"], default="auto")
    parser.add_argument("--budget-s", type=float, default=1.5, help="time per codec and size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a stage sets torch_threads)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prefill, source = activations(args.activations)
    tensors = {
        "decode 8×1×576": prefill[:, -1:, :].contiguous(),  # the last position stands in for a decode step
        "prefill 8×128×576": prefill,
    }
    rows = []
    for name, x in tensors.items():
        for case, spec in CASES:
            rows.append(measure(name, case, spec, x, args.budget_s))
            say(f"{name} {case}: {rows[-1].round_trip_us:,.0f} µs")
    command = " ".join([".venv/bin/python -m bench.codecs", *sys.argv[1:]])
    text = report(rows, source, prefill, command)
    print(text)
    write_results("codecs", text, {"source": source, "rows": [r.__dict__ | {"gbps": r.gbps()} for r in rows]})


if __name__ == "__main__":
    main()
