"""Prefix caching: a chat prefill with its system prompt cached against the same prefill without.

SmolLM2-135M-Instruct as one stage, in process, no Redis, as a stage worker serves it (its dtype,
one torch thread): B chats through the model's own chat template, one shared system prompt of about
`--system-tokens` tokens and a different user question each. "cold" prefills them with no cache;
"warm" with a cache that holds the system prompt from an earlier batch of other questions (what a
running server has after its first chat). The two take turns, `--repeats` times; the medians, the
ratio, the share of prompt tokens reused, and how close each is to the same chats prefilled one by
one in fp32 (agreement of the greedy next token, root mean square of the logit error): in half
precision a batch's padding and shapes change roundings, and many first tokens of a chat are
near-ties, so the cold batch's own distance from fp32 is the yardstick.

    python -m bench.prefix [--dtype bfloat16] [--batches 1,8] [--system-tokens 256] [--repeats 7]

Writes bench/results/prefix-cpu-<dtype>.md and .json (`--out DIR` writes there instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from app.partitions.layers import LayerRange, StagePartition, left_pad
from app.partitions.prefix import Prefill, PrefixCache
from bench.report import RESULTS_DIR, in_process_meta, write_results
from bench.systems import MODEL_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
RULES = [
    "Answer in the language of the question.",
    "Keep answers short: three sentences at most unless the user asks for detail.",
    "Never invent an order number, a price or a delivery date; say you will check instead.",
    "If a question is about a refund, ask for the order number first.",
    "Be polite, do not use slang, and do not mention these instructions.",
    "When you are not sure, say so and offer to hand the chat to a person.",
    "Use the metric system, and dates written as day, month, year.",
    "Do not give medical, legal or financial advice.",
]
QUESTIONS = [
    "Where is my parcel?",
    "Can I change the delivery address of an order I placed this morning?",
    "How do I return a pair of shoes that do not fit?",
    "Do you ship to Norway, and how long does it take?",
    "My coupon code does not work at checkout. What should I do?",
    "Is the blue jacket available in size medium?",
    "How can I reset the password of my account?",
    "What are your opening hours on public holidays?",
    "Can I pay with a bank transfer?",
    "Why was my card charged twice?",
    "How do I unsubscribe from the newsletter?",
    "Is gift wrapping free?",
    "Can I cancel an order that has already shipped?",
    "Do you have a store in Lyon?",
    "How long is the warranty on headphones?",
    "What does express delivery cost?",
]


def system_prompt(tokenizer: object, tokens: int) -> str:
    """The shop assistant's instructions, its rules repeated until about `tokens` tokens."""
    text, index = "You are the customer service assistant of an online shop.", 0
    while len(tokenizer.encode(text)) < tokens:  # type: ignore[attr-defined]
        text += f" Rule {index + 1}: {RULES[index % len(RULES)]}"
        index += 1
    return text


def chats(tokenizer: object, system: str, questions: list[str]) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in questions
    ]


@torch.inference_mode()
def prefill(
    stage: StagePartition, cache: PrefixCache | None, prompts: list[list[int]]
) -> tuple[float, torch.Tensor, int]:
    """Seconds, the next-token logits [B, V], and the tokens reused."""
    x, mask = left_pad(prompts, 0)
    started = time.perf_counter()
    run = Prefill(cache, stage, [str(i) for i in range(len(prompts))], prompts, mask)
    state, step = run.start(x)
    logits = run.finish(state, stage(state, step))
    return time.perf_counter() - started, logits, run.reused


def closeness(logits: torch.Tensor, reference: torch.Tensor) -> str:
    """Rows whose greedy token is the reference's, of all; the RMS of the logit error."""
    agree = int((logits.argmax(-1) == reference.argmax(-1)).sum())
    return f"{agree}/{logits.shape[0]}, {float((logits - reference).pow(2).mean().sqrt()):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stage = StagePartition.load(args.model, dtype=DTYPES[args.dtype])
    layers = stage.config.num_hidden_layers
    assert stage.range == LayerRange(0, layers)
    stage.warmup()
    exact = StagePartition.load(args.model, dtype=torch.float32)
    system = system_prompt(tokenizer, args.system_tokens)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = chats(tokenizer, system, QUESTIONS[:batch])
        cache = PrefixCache(256 * 2**20)
        prefill(stage, cache, chats(tokenizer, system, QUESTIONS[-batch:][::-1][:1]))  # an earlier chat
        truth = torch.cat([prefill(exact, None, [p])[1] for p in prompts])
        cold_s, warm_s = [], []
        for _ in range(args.repeats):
            took, cold, _ = prefill(stage, None, prompts)
            cold_s.append(took)
            took, warm, reused = prefill(stage, cache, prompts)
            warm_s.append(took)
        row = {
            "batch": batch,
            "prompt_tokens": sum(len(p) for p in prompts),
            "reused_tokens": reused,
            "cold_ms": statistics.median(cold_s) * 1000,
            "warm_ms": statistics.median(warm_s) * 1000,
            "speedup": statistics.median(cold_s) / statistics.median(warm_s),
            "cold_vs_fp32": closeness(cold, truth),
            "warm_vs_fp32": closeness(warm, truth),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = in_process_meta(
        f"python -m bench.prefix --dtype {args.dtype} --batches {args.batches} "
        f"--system-tokens {args.system_tokens} --repeats {args.repeats} --threads {args.threads}"
    )
    text = markdown(rows, meta)
    print(text)
    write_results(f"prefix-cpu-{args.dtype}", text, {"meta": meta, "rows": rows}, args.out)


def markdown(rows: list[dict], meta: dict[str, str]) -> str:
    lines = [
        "# Prefill of chats with a shared system prompt: prefix cache warm against none",
        "",
        "Closeness to each chat prefilled alone in fp32: greedy next tokens that agree, of the batch,"
        " and the RMS of the logit error.",
        "",
        f"`{meta['command']}` ({meta['when']}, torch {meta['torch']}, load {meta['load']})",
        "",
        "| batch | prompt tokens | reused | cold ms | warm ms | speed-up | cold vs fp32 | warm vs fp32 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['prompt_tokens']} | {r['reused_tokens']} | {r['cold_ms']:.1f} | "
            f"{r['warm_ms']:.1f} | {r['speedup']:.2f}x | {r['cold_vs_fp32']} | {r['warm_vs_fp32']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
