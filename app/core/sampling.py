"""Bounds on a job's sampling values: the API refuses values outside them (422), and the stage
worker refuses a stored job whose values are outside them (that job fails alone).

Past these bounds the numbers stop meaning anything and start breaking float32 arithmetic: a
temperature of 1e-300 divides the logits into infinities, a top_p that rounds to 0 in float32
masks every token, a top_k past int64 cannot become a tensor at all.
"""

from __future__ import annotations

import math

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


def sampling_problem(*, temperature: object, top_p: object, top_k: object) -> str | None:
    """What is wrong with these values (the field named first), or None when they may be used."""
    if not _number(temperature) or not (
        temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE  # type: ignore[operator]
    ):
        return temperature_problem(temperature)
    if not _number(top_p) or not MIN_TOP_P <= top_p <= 1:  # type: ignore[operator]
        return f"top_p must be between {MIN_TOP_P:g} and 1, not {top_p!r}"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        return f"top_k must be an integer between 0 (no cut) and {MAX_TOP_K}, not {top_k!r}"
    return None


def temperature_problem(value: object) -> str:
    return (
        f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, "
        f"not {value!r}"
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
