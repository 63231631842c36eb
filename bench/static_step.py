"""One stage's decode step, eager against static (captured as CUDA graphs on a GPU).

SmolLM2-135M-Instruct as one stage, in process, no Redis: a batch of B prompts of 100-160 tokens,
left-padded, one prefill, then decode steps. Two engines take turns step by step over the same
history (each fed the eager engine's greedy tokens): `StagePartition.forward` as it runs by default
(`CONVEYOR_COMPILE=off`), and the same stage with a `StaticDecode` (`app.partitions.static`:
`graphs` replays a CUDA graph per cache layout; `eager` runs the same fixed layout uncaptured, what
the layout alone costs). For each batch size: the median step, tokens/s, the ratio, how often the
greedy token agreed, the largest difference of a logit, and the time of the first static step
(its capture).

    python -m bench.static_step [--device cuda] [--dtype bfloat16] [--batches 1,16,64] [--steps 32]
                                [--mode graphs|eager] [--random-weights]

`--random-weights` builds the model from the checkpoint's config.json alone, with seeded random
weights: the timings are those of the real model (same shapes), the agreement is only a check that
both engines compute the same function. Writes bench/results/static_step-<cpu|cuda>-<dtype>.md and .json
(`--out DIR` writes there instead).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.static import StaticDecode

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".conveyor" / "models" / "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(rng.randrange(100, 161))] for _ in range(batch)]


def build(model_dir: Path, dtype: torch.dtype, device: str, random_weights: bool) -> StagePartition:
    if not random_weights:
        return StagePartition.load(model_dir, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    return StagePartition(model, LayerRange(0, config.num_hidden_layers)).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Engine:
    def __init__(self, name: str, stage: StagePartition, device: str) -> None:
        self.name, self.stage, self.device = name, stage, device
        self.state: BatchState | None = None
        self.timings: list[float] = []
        self.logits: list[torch.Tensor] = []

    @torch.inference_mode()
    def start(self, batch: int) -> torch.Tensor:
        ids, mask = left_pad(prompts(batch), 0)
        self.state = BatchState(self.stage.config, [str(i) for i in range(batch)], mask)
        self.timings, self.logits = [], []
        logits = self.stage(self.state, ids)
        sync(self.device)
        return logits.argmax(-1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.state is not None
        self.state.extend(1)
        sync(self.device)
        started = time.perf_counter()
        logits = self.stage(self.state, tokens[:, None].to(self.device))
        sync(self.device)
        self.timings.append(time.perf_counter() - started)
        self.logits.append(logits.float().cpu())
        return logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--mode",
        default="",
        help="graphs (a GPU) or eager (the fixed layout alone); default: graphs on a GPU, else eager",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = args.device, DTYPES[args.dtype]
    mode = args.mode or ("graphs" if device.startswith("cuda") else "eager")
    eager = Engine("eager", build(args.model, dtype, device, args.random_weights), device)
    fixed = Engine(mode, build(args.model, dtype, device, args.random_weights), device)
    fixed.stage.static = StaticDecode(fixed.stage, mode)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        feed = eager.start(batch)
        fixed.start(batch)
        first_started = time.perf_counter()
        fixed.step(feed)  # the first static step captures its graph
        first = time.perf_counter() - first_started
        feed = eager.step(feed)  # both engines one step on, over the same history
        for engine in (eager, fixed):
            engine.timings.clear()
            engine.logits.clear()
        for _ in range(args.steps):
            fed = feed
            feed = eager.step(fed)
            fixed.step(fed)
        agree = total = 0
        worst = 0.0
        for a, b in zip(eager.logits, fixed.logits, strict=True):
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            worst = max(worst, float((a - b).abs().max()))
        ms_eager = statistics.median(eager.timings) * 1000
        ms_fixed = statistics.median(fixed.timings) * 1000
        row = {
            "batch": batch,
            "eager_ms": ms_eager,
            "static_ms": ms_fixed,
            "speedup": ms_eager / ms_fixed,
            "first_static_step_s": first,
            "greedy_agreement": f"{agree}/{total}",
            "max_logit_difference": worst,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {
        "command": "python -m bench.static_step "
        + " ".join(
            f"--{k} {v}"
            for k, v in (
                ("device", device),
                ("dtype", args.dtype),
                ("batches", args.batches),
                ("steps", args.steps),
                ("mode", mode),
            )
        )
        + (" --random-weights" if args.random_weights else ""),
        "device": name,
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.environ.get("CONVEYOR_COMMIT", ""),
    }
    text = markdown(rows, meta, mode)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"static_step-{'cuda' if device.startswith('cuda') else 'cpu'}-{args.dtype}"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def markdown(rows: list[dict], meta: dict[str, str], mode: str) -> str:
    lines = [
        f"# One decode step: eager against the fixed layout ({mode}) on {meta['device']}",
        "",
        f"`{meta['command']}` — torch {meta['torch']}, {meta['when']}"
        + (f", commit {meta['commit']}" if meta["commit"] else "")
        + ". SmolLM2-135M-Instruct shapes as one stage; prompts of 100-160 tokens left-padded; "
        "the engines take turns step by step over the same history; medians.",
        "",
        f"| batch | eager ms | fixed ({mode}) ms | speedup | eager tok/s | fixed ({mode}) tok/s "
        f"| first fixed ({mode}) step s "
        "| greedy agreement | max logit difference |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['eager_ms']:.2f} | {r['static_ms']:.2f} | {r['speedup']:.2f}× "
            f"| {r['batch'] / r['eager_ms'] * 1000:.0f} | {r['batch'] / r['static_ms'] * 1000:.0f} "
            f"| {r['first_static_step_s']:.2f} | {r['greedy_agreement']} | {r['max_logit_difference']:.2e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
