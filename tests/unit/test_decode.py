"""The last stage's per-token rules (`app.workers.decode`): why a sequence ends, what it streams,
which rows go on to the next step. Sequences over the tiny byte-level tokenizer, no Redis."""

from __future__ import annotations

import torch
from tiny import make_tokenizer

from app.workers.decode import Sequence, advance, compacted, held_tokens, settle
from app.workers.sampling import SamplingParams
from app.workers.textstream import TextStream

TOKENIZER = make_tokenizer()
EOS = frozenset({int(TOKENIZER.eos_token_id)})


def ids(text: str) -> list[int]:
    return list(TOKENIZER(text).input_ids)


def sequence(
    job_id: str = "j", *, max_tokens: int = 16, stop: list[str] | None = None, **fields: object
) -> Sequence:
    return Sequence(
        job_id,
        "batch",
        SamplingParams(),
        torch.Generator(),
        max_tokens,
        TextStream(TOKENIZER, stop),
        **fields,  # type: ignore[arg-type]
    )


def run(seq: Sequence, tokens: list[int]):  # type: ignore[no-untyped-def]
    outs = []
    for token in tokens:
        outs.append(advance(seq, token, EOS))
        if seq.finish_reason is not None:
            break
    return outs


def test_tokens_stream_their_text_until_the_length_limit() -> None:
    seq = sequence(max_tokens=3)
    outs = run(seq, ids("abcdef"))
    assert [o.index for o in outs] == [0, 1, 2] and seq.generated == 3
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    assert "".join(o.text for o in outs) == outs[-1].completion_text == "abc"


def test_end_of_sequence_stops_and_is_not_counted_or_streamed() -> None:
    seq = sequence()
    *_, last = run(seq, [*ids("hi"), *EOS])
    assert (seq.finish_reason, seq.generated) == ("stop", 2)
    assert (last.index, last.finish_reason, last.text, last.emit) == (2, "stop", "", False)
    assert last.completion_text == "hi"


def test_end_of_sequence_releases_text_held_back() -> None:
    seq = sequence(stop=["xyz"])  # "x" might start the stop string: held back
    outs = run(seq, [*ids("abx"), *EOS])
    assert "".join(o.text for o in outs[:3]) == "ab"
    assert (outs[-1].text, outs[-1].emit, outs[-1].finish_reason) == ("x", True, "stop")


def test_ignore_eos_generates_through_end_of_sequence() -> None:
    seq = sequence(max_tokens=3, ignore_eos=True)
    outs = run(seq, [*EOS, *EOS, *EOS])
    assert [o.finish_reason for o in outs] == [None, None, "length"] and seq.generated == 3
    assert all(o.emit for o in outs)


def test_a_stop_string_ends_the_sequence_and_is_never_streamed() -> None:
    seq = sequence(stop=["STOP"])
    outs = run(seq, ids("one STOP two"))
    assert seq.finish_reason == "stop" and outs[-1].finish_reason == "stop"
    assert len(outs) == len(ids("one STOP"))  # ended on the token that completed it
    assert "".join(o.text for o in outs) == outs[-1].completion_text == "one "


def test_end_of_sequence_is_held_until_min_tokens() -> None:
    rows = [sequence("a", min_tokens=2), sequence("b", min_tokens=2, generated=2), sequence("c")]
    assert held_tokens(rows, EOS) == [EOS, frozenset(), frozenset()]
    advance(rows[0], ids("z")[0], EOS)
    advance(rows[0], ids("z")[0], EOS)
    assert held_tokens(rows, EOS)[0] == frozenset()


def test_settle_keeps_the_rows_that_go_on() -> None:
    rows = [sequence("done", max_tokens=1), sequence("cancelled"), sequence("going")]
    table = {s.job_id: s for s in rows}
    tokens = ids("abc")
    for seq, token in zip(rows, tokens, strict=True):
        advance(seq, token, EOS)
    alive = settle(table, rows, tokens, gone={"cancelled"})
    assert alive == [("going", tokens[2])]
    assert list(table) == ["going"]


def test_a_seeded_sequence_draws_the_same_for_the_same_token_index() -> None:
    seq = sequence()
    seq.params = SamplingParams(seed=1234)
    seq.reseed()
    first = torch.rand(3, generator=seq.generator)
    seq.generated = 5
    seq.reseed()
    other = torch.rand(3, generator=seq.generator)
    seq.generated = 0
    seq.reseed()
    assert torch.equal(torch.rand(3, generator=seq.generator), first) and not torch.equal(first, other)


def test_the_rows_that_go_on_fill_the_places_of_the_rows_that_ended() -> None:
    """Each row that goes on keeps its place but the last ones, which take the places of the first
    rows that ended: a KV cache moves as many rows as ended, not every row behind the first."""
    rows = [sequence(name) for name in ("a", "b", "c", "d", "e")]
    table = {s.job_id: s for s in rows}
    tokens = ids("abcde")
    for seq in (rows[1], rows[3]):
        seq.finish_reason = "length"
    alive = settle(table, rows, tokens, gone=set())
    assert alive == [("a", tokens[0]), ("e", tokens[4]), ("c", tokens[2])]
    assert set(table) == {"a", "c", "e"}
    assert compacted(list("abcdef"), [False, False, True, True, True, True]) == list("efcd")
    assert compacted(list("abc"), [True, True, True]) == list("abc")
    assert compacted(list("abc"), [False, False, False]) == []
