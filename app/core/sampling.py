"""A job's sampling values (`SamplingParams`: the one shape they travel in, from the API's
`JobCreate` through the record's `request` to the last stage's sampler) and their bounds: the API
refuses values outside them (422), and the stage worker refuses a stored job whose values are
outside them (that job fails alone).

Past these bounds the numbers stop meaning anything and start breaking float32 arithmetic: a
temperature of 1e-300 divides the logits into infinities, a top_p that rounds to 0 in float32
masks every token, a top_k past int64 cannot become a tensor at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

# 0 means greedy. Below 0.01 sampling is greedy in all but name (logits / 0.01 already gives the
# top token all the mass unless two are within ~0.05), and float32 stays finite.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
# A nucleus smaller than 0.1 % of the mass keeps the top token alone, as greedy does; the floor
# keeps top_p far from float32's rounding to 0 (which would drop every token).
MIN_TOP_P = 1e-3
# top_k: 0 turns the cut off; a value at or past the vocabulary keeps every token. The cap only
# keeps it an int32 (no vocabulary comes near it).
MAX_TOP_K = 2**31 - 1
# OpenAI's ranges: a penalty of 2 per occurrence, a bias of 100, already decide any choice.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# repetition_penalty divides (or multiplies) a logit: past these a seen token is banned or forced,
# and a tiny one would divide logits into infinities.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
# Entries in logit_bias, allowed_token_ids and stop_token_ids; words in bad_words. They ride in the
# job's record and are applied at every step.
MAX_TOKEN_LIST = 4096
MAX_BAD_WORDS = 256
# Alternatives a token's log probabilities may list (vLLM's default max_logprobs, OpenAI's chat cap).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks a job's next token. Built by the API (`JobCreate`), stored in the
    job's `request` (`JobRequest`), read by the last stage (`app.workers.sampling`). The controls
    after `seed` are vLLM's (and OpenAI's, for the penalties and `logit_bias`), defined as vLLM
    applies them; each one's default changes nothing."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (> 0) or multiplies (< 0) a prompt's or output's token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output may not complete
    stop_token_ids: tuple[int, ...] = ()  # end the output as end-of-sequence does (not in the text)
    # Each token's log probability and its `logprobs` likeliest alternatives, from the model's own
    # logits (before any control or temperature, vLLM's "raw" logprobs); None: not computed.
    logprobs: int | None = None
    # Echo's log probabilities of the prompt's tokens (each given the tokens before it) and this
    # many likeliest alternatives at each position, computed at the prefill; None: not computed.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)

    @property
    def constrained(self) -> bool:
        """Whether a control changes the logits before sampling (`app.workers.sampling.constrain`)."""
        return bool(self.penalized or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    def problem(self, vocab: int | None = None) -> str | None:
        """Why these values may not be used (a job stored with them fails), or None. With `vocab`
        (the model's vocabulary size), token ids outside it are a problem too."""
        return sampling_problem(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k) or (
            _controls_problem(self, vocab)
        )

    def bounded(self, vocab: int) -> SamplingParams:
        """The same choice inside the bounds: NaN or <= 0 temperature is greedy, a tiny one the
        smallest, a huge one the largest; top_p in [MIN_TOP_P, 1] (NaN: 1); top_k in [0, vocab];
        min_p in [0, 1] (NaN: 0)."""
        temperature = _number(self.temperature, 0.0)
        temperature = 0.0 if not temperature > 0 else min(max(temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
        top_p = min(max(_number(self.top_p, 1.0), MIN_TOP_P), 1.0)
        top_k = int(min(max(_number(self.top_k, 0.0), 0.0), float(vocab)))
        min_p = min(max(_number(self.min_p, 0.0), 0.0), 1.0)
        return replace(self, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the four fields every record has always had, then each control that
        is not at its default."""
        value: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }
        for name, default in _CONTROLS.items():
            if getattr(self, name) != default:
                value[name] = getattr(self, name)
        if self.logit_bias:
            value["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return value

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SamplingParams:
        """A stored request's values; fields added after it was written take their defaults."""
        allowed = value.get("allowed_token_ids")
        return cls(
            temperature=value["temperature"],
            top_p=value["top_p"],
            top_k=value["top_k"],
            seed=value.get("seed"),
            min_p=value.get("min_p", 0.0),
            presence_penalty=value.get("presence_penalty", 0.0),
            frequency_penalty=value.get("frequency_penalty", 0.0),
            repetition_penalty=value.get("repetition_penalty", 1.0),
            logit_bias=tuple((int(t), float(b)) for t, b in value.get("logit_bias") or ()),
            allowed_token_ids=None if allowed is None else tuple(int(t) for t in allowed),
            bad_words=tuple(tuple(int(t) for t in word) for word in value.get("bad_words") or ()),
            stop_token_ids=tuple(int(t) for t in value.get("stop_token_ids") or ()),
            logprobs=value.get("logprobs"),
            prompt_logprobs=value.get("prompt_logprobs"),
        )


# The controls stored only when set, with their defaults (logit_bias is stored as pairs).
_CONTROLS: dict[str, Any] = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "allowed_token_ids": None,
    "bad_words": (),
    "stop_token_ids": (),
    "logprobs": None,
    "prompt_logprobs": None,
}


def _controls_problem(params: SamplingParams, vocab: int | None) -> str | None:
    """What is wrong with vLLM's controls (the field named first), or None."""
    if not _finite(params.min_p) or not 0 <= params.min_p <= 1:  # type: ignore[operator]
        return f"min_p must be between 0 and 1, not {params.min_p!r}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            return f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, not {value!r}"
    penalty = params.repetition_penalty
    if not _finite(penalty) or not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:  # type: ignore[operator]
        return (
            f"repetition_penalty must be between {MIN_REPETITION_PENALTY:g} and "
            f"{MAX_REPETITION_PENALTY:g} (1 is none), not {penalty!r}"
        )
    if any(not _finite(b) or abs(b) > MAX_LOGIT_BIAS for _, b in params.logit_bias):
        return f"logit_bias values must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        return "allowed_token_ids may not be empty (leave it out to allow every token)"
    for name in ("logprobs", "prompt_logprobs"):
        count = getattr(params, name)
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_LOGPROBS
        ):
            return f"{name} must be an integer between 0 and {MAX_LOGPROBS}, not {count!r}"
    if len(params.bad_words) > MAX_BAD_WORDS:
        return f"bad_words has {len(params.bad_words)} words, more than {MAX_BAD_WORDS}"
    lists = {
        "logit_bias": [t for t, _ in params.logit_bias],
        "allowed_token_ids": list(params.allowed_token_ids or ()),
        "stop_token_ids": list(params.stop_token_ids),
    }
    for name, ids in lists.items():
        if len(ids) > MAX_TOKEN_LIST:
            return f"{name} has {len(ids)} token ids, more than {MAX_TOKEN_LIST}"
        outside = [t for t in ids if not 0 <= t < (vocab if vocab is not None else 2**31)]
        if outside:
            return f"{name} holds token id {outside[0]}, outside the vocabulary (0 to {(vocab or 2**31) - 1})"
    return None


MASK64 = (1 << 64) - 1


def sibling_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request for several choices (`n`) with `seed`: the seed
    itself for the first (so its first choice is the answer the same request with n=1 gives), then
    SplitMix64 of (seed, index), different for every choice and the same on every run."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # a job's seed is at most 2**63 - 1


def sampling_problem(*, temperature: object, top_p: object, top_k: object) -> str | None:
    """What is wrong with these values (the field named first), or None when they may be used."""
    if not _finite(temperature) or not (
        temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE  # type: ignore[operator]
    ):
        return temperature_problem(temperature)
    if not _finite(top_p) or not MIN_TOP_P <= top_p <= 1:  # type: ignore[operator]
        return f"top_p must be between {MIN_TOP_P:g} and 1, not {top_p!r}"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        return f"top_k must be an integer between 0 (no cut) and {MAX_TOP_K}, not {top_k!r}"
    return None


def temperature_problem(value: object) -> str:
    return (
        f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, "
        f"not {value!r}"
    )


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: object, default: float) -> float:
    """`value` as a float; `default` for NaN or anything that is not a number."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return default
    return default if math.isnan(number) else number
