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


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks a job's next token. Built by the API (`JobCreate`), stored in the
    job's `request` (`JobRequest`), read by the last stage (`app.workers.sampling.sample`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problem(self) -> str | None:
        """Why these values may not be used (a job stored with them fails), or None."""
        return sampling_problem(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def bounded(self, vocab: int) -> SamplingParams:
        """The same choice inside the bounds: NaN or <= 0 temperature is greedy, a tiny one the
        smallest, a huge one the largest; top_p in [MIN_TOP_P, 1] (NaN: 1); top_k in [0, vocab]."""
        temperature = _number(self.temperature, 0.0)
        temperature = 0.0 if not temperature > 0 else min(max(temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
        top_p = min(max(_number(self.top_p, 1.0), MIN_TOP_P), 1.0)
        top_k = int(min(max(_number(self.top_k, 0.0), 0.0), float(vocab)))
        return replace(self, temperature=temperature, top_p=top_p, top_k=top_k)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the four fields every record has always had."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SamplingParams:
        """A stored request's values; fields added after it was written take their defaults."""
        return cls(
            temperature=value["temperature"],
            top_p=value["top_p"],
            top_k=value["top_k"],
            seed=value.get("seed"),
        )


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
