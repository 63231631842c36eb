import torch

from app.workers.sampling import SamplingParams, ban_tokens, filter_logits, make_generator, sample


def logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    params = [SamplingParams(temperature=0.0)] * 3
    assert sample(x, params, [make_generator(p) for p in params]).tolist() == x.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits()
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        params = [p] * 3
        assert sample(x, params, [make_generator(p) for p in params]).tolist() == x.argmax(-1).tolist()


def test_seed_reproduces_and_rows_are_independent():
    x = logits()
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    first = sample(x, params, [make_generator(p) for p in params])
    again = sample(x, params, [make_generator(p) for p in params])
    assert first.tolist() == again.tolist()
    alone = sample(x[1:2], params[1:2], [make_generator(params[1])])
    assert alone.tolist() == first[1:2].tolist()


def test_filter_keeps_exactly_top_k_and_the_nucleus():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = filter_logits(x, top_k=torch.tensor([2]), top_p=torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False, False]]
    probs = x.softmax(-1)[0]
    p = float(probs[0] + probs[1] / 2)  # the nucleus needs the first two tokens
    kept = filter_logits(x, top_k=torch.tensor([0]), top_p=torch.tensor([p])).isfinite()
    assert kept.tolist() == [[True, True, False, False, False]]


def test_sampling_never_picks_a_filtered_token():
    x = logits(rows=1, vocab=100)
    params = [SamplingParams(temperature=1.5, top_k=3, seed=0)]
    gen = make_generator(params[0])
    allowed = set(x[0].topk(3).indices.tolist())
    assert all(int(sample(x, params, [gen])[0]) in allowed for _ in range(50))


def test_banned_tokens_are_never_sampled_and_other_rows_are_untouched():
    x = logits()
    eos = int(x[0].argmax())
    banned = [frozenset({eos, 10_000}), frozenset()]  # an id outside the vocabulary is skipped
    held = ban_tokens(x[:2], banned)
    assert held[0, eos] == float("-inf") and torch.equal(held[1], x[1])
    assert torch.equal(x, logits()), "the input is not modified"
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert sample(held, greedy, [make_generator(p) for p in greedy])[0] != eos
    hot = [SamplingParams(temperature=2.0, seed=s) for s in range(50)]
    rows = held[:1].expand(50, -1)
    drawn = sample(rows, hot, [make_generator(p) for p in hot])
    assert eos not in drawn.tolist()
    assert ban_tokens(x, [frozenset()] * 3) is x


def test_a_seeded_tokens_draw_depends_on_its_seed_and_index_only() -> None:
    """token_seed: deterministic, distinct per index and per seed, a valid torch seed; a generator set
    from it for index n draws the same whatever it drew before (what recovery relies on)."""
    from app.workers.sampling import token_seed

    seeds = [token_seed(1234, i) for i in range(1000)]
    assert seeds == [token_seed(1234, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and len({token_seed(s, 0) for s in range(1000)}) == 1000
    assert all(0 <= s < 2**63 for s in seeds + [token_seed(2**64 - 1, 2**40)])
    probs = torch.softmax(torch.randn(50), dim=-1)
    used, fresh = torch.Generator(), torch.Generator()
    for _ in range(7):
        torch.multinomial(probs, 1, generator=used)  # a generator that has drawn before
    draws = []
    for generator in (used, fresh):
        generator.manual_seed(token_seed(1234, 7))
        draws.append(torch.multinomial(probs, 1, generator=generator).item())
    assert draws[0] == draws[1]


def test_top_k_and_min_p_without_a_nucleus_keep_what_the_sorted_cut_keeps():
    """The threshold path (no row with top_p < 1) keeps exactly the tokens a cut over the sorted
    row keeps: each row's k most likely (distinct logits), and those at least min_p of the likeliest."""
    x = logits(rows=4, vocab=500, seed=3)
    top_k, min_p = torch.tensor([0, 1, 7, 499]), torch.tensor([0.0, 0.0, 0.05, 0.2])
    kept = filter_logits(x, top_k=top_k, top_p=torch.ones(4), min_p=min_p).isfinite()
    probs = x.softmax(-1)
    for row in range(4):
        k = int(top_k[row]) or 500
        want = set(x[row].topk(k).indices.tolist())
        want &= {t for t in range(500) if probs[row, t] >= min_p[row] * probs[row].max()}
        assert set(kept[row].nonzero().squeeze(-1).tolist()) == want, row


def test_a_row_whose_logits_make_no_distribution_takes_its_greedy_token():
    """NaN or infinite logits in one row: that row's greedy token, the others sampled as usual."""
    x = logits(rows=3, vocab=50, seed=5)
    x[0, 7], x[2, 3] = float("nan"), float("inf")
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    got = sample(x, params, [make_generator(p) for p in params])
    alone = sample(x[1:2], params[1:2], [make_generator(params[1])])
    assert got[0] == x[0].argmax() and got[2] == x[2].argmax() and got[1] == alone[0]


def test_unseeded_draws_follow_the_distribution_and_never_take_a_zero():
    """`draw` (rows without a seed) over 40,000 rows: each token's frequency within 2% of its
    probability, the token of probability zero (between two others) never drawn; a generator
    seeded alike draws alike."""
    from app.workers.sampling import draw

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    generators = [torch.Generator().manual_seed(s) for s in range(40_000)]
    drawn = draw(probs.expand(40_000, -1), generators)
    counts = torch.bincount(drawn, minlength=5) / 40_000
    assert counts[1] == 0 and (counts - probs).abs().max() < 0.02, counts.tolist()
    again = draw(probs.expand(3, -1), [torch.Generator().manual_seed(s) for s in range(3)])
    assert again.tolist() == drawn[:3].tolist()


def test_unseeded_draws_across_the_vocabularys_blocks_follow_the_distribution():
    """A vocabulary of several of `draw`'s blocks, the last one partial: tokens at the blocks' edges
    drawn as often as their probabilities, none of probability zero (the blocks' own edges, the
    padding past the vocabulary) ever; a row whose mass is all in the last block draws from it."""
    from app.workers.sampling import DRAW_BLOCK, draw

    vocab = 2 * DRAW_BLOCK + 452
    mass = {
        0: 0.1,
        DRAW_BLOCK - 1: 0.2,
        DRAW_BLOCK: 0.25,
        2 * DRAW_BLOCK - 1: 0.05,
        2 * DRAW_BLOCK: 0.3,
        vocab - 1: 0.1,
    }
    probs = torch.zeros(vocab)
    for token, p in mass.items():
        probs[token] = p
    rows = 40_000
    drawn = draw(probs.expand(rows, -1), [torch.Generator().manual_seed(s) for s in range(rows)])
    counts = torch.bincount(drawn, minlength=vocab) / rows
    assert set(counts.nonzero().squeeze(-1).tolist()) <= set(mass), "a token of probability zero was drawn"
    assert max(abs(float(counts[t]) - p) for t, p in mass.items()) < 0.02, counts[list(mass)].tolist()
    last = torch.zeros(vocab)
    last[vocab - 3 :] = torch.tensor([0.5, 0.0, 0.5])
    tail = draw(last.expand(1_000, -1), [torch.Generator().manual_seed(s) for s in range(1_000)])
    assert set(tail.tolist()) == {vocab - 3, vocab - 1}


def test_unseeded_and_seeded_rows_in_one_batch_each_take_their_draw():
    """A batch of seeded and unseeded rows: each seeded row draws what torch.multinomial draws
    from its generator alone (transformers' draw), each unseeded row a token its filter allows."""
    x = logits(rows=6, vocab=80, seed=9)
    params = [SamplingParams(temperature=1.0, top_k=5, seed=s if s % 2 else None) for s in range(6)]
    generators = [make_generator(p) for p in params]
    got = sample(x, params, generators)
    for row, p in enumerate(params):
        allowed = set(x[row].topk(5).indices.tolist())
        assert int(got[row]) in allowed
        if p.seed is not None:
            probs = filter_logits(x[row : row + 1], top_k=torch.tensor([5]), top_p=torch.ones(1)).softmax(-1)
            want = torch.multinomial(probs[0], 1, generator=make_generator(p))[0]
            assert got[row] == want, row
