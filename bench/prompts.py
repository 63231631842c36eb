"""The benchmark prompt set: seeded chat requests whose user messages span a range of token lengths.

`make_prompts` draws the requests from a fixed seed, so a run and its rerun (and every system within a
run) see the same prompts; each one carries its chat-templated token ids, rendered exactly as Conveyor's
api (and the naive server) render a chat request. `spread` picks a subset evenly over the lengths.
`text_prompt` is a raw prompt instead (its text, no messages).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SEED = 20240601
USER_TOKENS = (10, 120)  # the range of user-message lengths, in tokens


@dataclass(frozen=True)
class Prompt:
    index: int
    messages: list[dict[str, str]]
    user_tokens: int
    ids: list[int]  # the chat-templated prompt every system sees
    text: str = ""  # a raw prompt's text (no messages): /v1/completions, /v1/inference


def text_prompt(index: int, text: str) -> Prompt:
    """A raw prompt, sent as text rather than chat messages."""
    return Prompt(index, [], 0, [], text)


TOPICS = (
    "the water cycle, black holes, sourdough bread, the French revolution, public key cryptography, "
    "photosynthesis, compound interest, the immune system, plate tectonics, jazz improvisation, "
    "machine learning, the Roman empire, electric cars, coral reefs, the printing press, volcanoes, "
    "honey bees, the stock market, vaccines, solar panels"
).split(", ")
TASKS = [
    "Define {topic}.",
    "Tell me about {topic}.",
    "Explain {topic} in simple terms.",
    "Write a short poem about {topic}.",
    "Give me three facts about {topic}.",
    "What are the main debates about {topic}?",
    "Summarize what is known about {topic}.",
    "How would you teach {topic} to a ten-year-old?",
    "List common misconceptions about {topic}.",
    "Why does {topic} matter today?",
]
CONTEXT = [
    "I am preparing a talk for my local library next week.",
    "My audience has no background in science or history.",
    "Please keep the tone friendly and avoid jargon where you can.",
    "I read an article about this yesterday and got confused by the details.",
    "Use an example from everyday life if that helps.",
    "My teacher said the textbook explanation is incomplete, so I want a second view.",
    "I only have about five minutes to present it, so be brief.",
    "Some of the listeners are retired engineers who like precise numbers.",
    "Last time I tried to explain it, people asked many follow-up questions I could not answer.",
    "Structure the answer in short paragraphs with a clear conclusion.",
    "If there is a famous person connected to it, mention them.",
    "I also want to know how our understanding of it changed over the last hundred years.",
    "Point out anything that is still uncertain or disputed among experts.",
    "My friend claims it is overrated, and I would like arguments either way.",
]


def user_length(rng: random.Random, user_tokens: tuple[int, int] = USER_TOKENS) -> int:
    """Target user-message length in tokens: mostly short, a long tail, within `user_tokens`."""
    low, high = user_tokens
    return int(min(high, max(low, rng.lognormvariate(math.log(36), 0.6))))


def user_message(
    rng: random.Random, tokenizer: Any, target: int, user_tokens: tuple[int, int] = USER_TOKENS
) -> str:
    """A task about a topic, with context sentences added until it reaches `target` tokens."""
    text = rng.choice(TASKS).format(topic=rng.choice(TOPICS))
    for sentence in rng.sample(CONTEXT, len(CONTEXT)):
        if len(tokenizer(text).input_ids) >= target:
            break
        longer = f"{sentence} {text}" if rng.random() < 0.5 else f"{text} {sentence}"
        if len(tokenizer(longer).input_ids) > user_tokens[1]:
            break
        text = longer
    return text


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt token ids exactly as Conveyor's api (and the naive server) render a chat request."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def make_prompts(
    tokenizer: Any, count: int, seed: int = SEED, user_tokens: tuple[int, int] = USER_TOKENS
) -> list[Prompt]:
    """`count` single-message chat requests drawn from `seed`: the same arguments give the same prompts."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        content = user_message(rng, tokenizer, user_length(rng, user_tokens), user_tokens)
        messages = [{"role": "user", "content": content}]
        length = len(tokenizer(content).input_ids)
        prompts.append(Prompt(index, messages, length, chat_ids(tokenizer, messages)))
    return prompts


def spread(prompts: Sequence[Prompt], count: int) -> list[Prompt]:
    """`count` prompts evenly spaced over the prompt lengths, in their original order."""
    ordered = sorted(prompts, key=lambda p: (len(p.ids), p.index))
    step = len(ordered) / count
    chosen = {ordered[int(step * i + step / 2)].index for i in range(count)}
    return [p for p in prompts if p.index in chosen]
