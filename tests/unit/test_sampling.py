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
