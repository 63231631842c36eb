from tiny import make_tokenizer

from app.workers.textstream import TextStream

TOKENIZER = make_tokenizer()


def feed(text: str, stop: list[str] | None = None) -> tuple[list[str], TextStream]:
    stream = TextStream(TOKENIZER, stop)
    pieces = []
    for token in TOKENIZER(text).input_ids:
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    else:
        pieces.append(stream.finish())
    return pieces, stream


def test_pieces_add_up_to_the_text_with_multibyte_characters():
    pieces, stream = feed("héllo wörld ✓ done")
    assert "".join(pieces) == stream.released == "héllo wörld ✓ done"
    assert all("\ufffd" not in p for p in pieces), "half characters are held back"


def test_stop_string_cuts_the_text_and_is_never_streamed():
    pieces, stream = feed("one two STOP three", stop=["STOP"])
    assert stream.stopped
    assert "".join(pieces) == stream.released == "one two "
    assert not any("S" in p for p in pieces)


def test_a_possible_stop_prefix_is_held_then_released():
    stream = TextStream(TOKENIZER, ["END"])
    out = [stream.push(t) for t in TOKENIZER("abcEN").input_ids]
    assert "".join(out) == "abc"
    out.append(stream.push(TOKENIZER("x").input_ids[0]))
    assert "".join(out) == "abcENx" and not stream.stopped


def test_finish_releases_a_held_tail():
    stream = TextStream(TOKENIZER, ["END"])
    out = [stream.push(t) for t in TOKENIZER("abcE").input_ids]
    out.append(stream.finish())
    assert "".join(out) == "abcE"


def test_special_tokens_are_left_out_unless_skip_special_tokens_is_false():
    ids = [
        *TOKENIZER("a").input_ids,
        TOKENIZER.convert_tokens_to_ids("<|im_start|>"),
        *TOKENIZER("b").input_ids,
    ]
    for skip, text in ((True, "ab"), (False, "a<|im_start|>b")):
        stream = TextStream(TOKENIZER, skip_special_tokens=skip)
        pieces = [stream.push(token) for token in ids] + [stream.finish()]
        assert "".join(pieces) == text
