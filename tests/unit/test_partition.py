"""A model cut into stages gives the same greedy tokens as the whole model's generate()."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def greedy(parts, config, prompts, steps):  # type: ignore[no-untyped-def]
    x, mask = left_pad(prompts, pad_id=0)
    states = [BatchState(config, [str(i) for i in range(len(prompts))], mask.clone()) for _ in parts]
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        h = x
        for part, state in zip(parts, states, strict=True):
            if step:
                state.extend(1)
            h = part(state, h)
        nxt = h.argmax(-1)
        for row, token in enumerate(nxt.tolist()):
            out[row].append(token)
        x = nxt[:, None]
    return out


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stages_match_generate(model_and_tokenizer, stages):  # type: ignore[no-untyped-def]
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(p).input_ids for p in ["a", "hello there", "a much longer prompt than the others"]]
    layers = model.config.num_hidden_layers
    parts = [StagePartition(model, LayerRange.even_split(layers, stages, s)) for s in range(stages)]
    got = greedy(parts, model.config, prompts, 10)
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10, min_new_tokens=10
        )[0, len(prompt) :].tolist()
        assert tokens == ref


def test_keep_drops_finished_rows(model_and_tokenizer):  # type: ignore[no-untyped-def]
    model, _ = model_and_tokenizer
    part = StagePartition(model, LayerRange(0, model.config.num_hidden_layers))
    x, mask = left_pad([[1, 2, 3], [4, 5]], pad_id=0)
    state = BatchState(model.config, ["a", "b"], mask)
    part(state, x)
    state.keep(["b"])
    # b's one column of left padding is no one's any more: mask and cache lose it
    assert state.seq_ids == ["b"] and state.attention_mask.shape == (1, 2)
    assert state.attention_mask.tolist() == [[1, 1]]
    assert state.cache.layers[0].keys.shape[0] == 1 and state.cache.layers[0].keys.shape[2] == 2
    with pytest.raises(KeyError):
        state.keep(["zzz"])


def test_a_step_interrupted_between_layers_by_another_batch_stays_exact(model_and_tokenizer):  # type: ignore[no-untyped-def]
    """An urgent prefill runs between two layers of a running batch's step (the worker's
    preemption): both batches get the tokens they get alone."""
    model, tokenizer = model_and_tokenizer
    part = StagePartition(model, LayerRange(0, model.config.num_hidden_layers))
    running = [tokenizer(p).input_ids for p in ["a running batch", "of two prompts, one longer"]]
    urgent = [tokenizer("an urgent prompt").input_ids]
    alone_running = greedy([part], model.config, running, 4)
    alone_urgent = greedy([part], model.config, urgent, 4)

    x, mask = left_pad(running, pad_id=0)
    state = BatchState(model.config, ["a", "b"], mask)
    got_running: list[list[int]] = [[], []]
    got_urgent: list[list[int]] = []
    suspensions = 0
    for step in range(4):
        if step:
            state.extend(1)
        steps = part.steps(state, x)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                nxt = done.value.argmax(-1)
                break
            suspensions += 1
            if step == 2 and suspensions == 3 * (model.config.num_hidden_layers - 1) - 1:
                got_urgent.extend(greedy([part], model.config, urgent, 4))  # between two layers
        for row, token in enumerate(nxt.tolist()):
            got_running[row].append(token)
        x = nxt[:, None]
    assert suspensions == 4 * (model.config.num_hidden_layers - 1)  # between every two layers, once
    assert got_urgent == alone_urgent
    assert got_running == alone_running


def test_even_split_covers_every_layer_once():
    ranges = [LayerRange.even_split(30, 4, s) for s in range(4)]
    assert ranges[0].start == 0 and ranges[-1].stop == 30
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    with pytest.raises(ValueError):
        LayerRange.even_split(2, 3, 0)


def test_a_batch_joining_a_running_one_keeps_every_row_exact(model_and_tokenizer):  # type: ignore[no-untyped-def]
    """Batch A decodes 3 steps, then batch B (prefilled alone) joins it: both match generate()."""
    model, tokenizer = model_and_tokenizer
    part = StagePartition(model, LayerRange(0, model.config.num_hidden_layers))
    a_prompts = [tokenizer(p).input_ids for p in ["first prompt", "x"]]
    b_prompts = [tokenizer(p).input_ids for p in ["a joiner with a longer prompt than A's", "yo"]]

    def start(prompts, ids):  # type: ignore[no-untyped-def]
        x, mask = left_pad(prompts, pad_id=0)
        state = BatchState(model.config, ids, mask)
        return state, part(state, x).argmax(-1)

    a, a_next = start(a_prompts, ["a0", "a1"])
    out = {"a0": [a_next[0].item()], "a1": [a_next[1].item()]}
    for _ in range(3):
        a.extend(1)
        a_next = part(a, a_next[:, None]).argmax(-1)
        out["a0"].append(a_next[0].item())
        out["a1"].append(a_next[1].item())
    b, b_next = start(b_prompts, ["b0", "b1"])
    out.update({"b0": [b_next[0].item()], "b1": [b_next[1].item()]})
    a.keep(["a1"])  # a0 finished meanwhile
    a.absorb(b)
    tokens = torch.tensor([a_next[1].item(), b_next[0].item(), b_next[1].item()])
    for _ in range(4):
        a.extend(1)
        tokens = part(a, tokens[:, None]).argmax(-1)
        for seq_id, token in zip(a.seq_ids, tokens.tolist(), strict=True):
            out[seq_id].append(token)
    for seq_id, prompt in zip(["a1", "b0", "b1"], [a_prompts[1], *b_prompts], strict=True):
        ids = torch.tensor([prompt])
        n = len(out[seq_id])
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n
        )[0, len(prompt) :].tolist()
        assert out[seq_id] == ref, seq_id


@pytest.mark.parametrize("cuts", [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_loaded_stages_hold_only_their_tensors_and_match_the_whole_model(
    tiny_model, model_and_tokenizer, cuts
):  # type: ignore[no-untyped-def]
    model, tokenizer = model_and_tokenizer
    whole = StagePartition(model, LayerRange(0, model.config.num_hidden_layers))
    parts = [StagePartition.load(tiny_model, LayerRange(a, b)) for a, b in cuts]
    x, mask = left_pad([tokenizer(p).input_ids for p in ["one", "two three four"]], pad_id=0)
    h = x
    for part in parts:
        h = part(BatchState(model.config, ["a", "b"], mask.clone()), h)
    assert torch.equal(h, whole(BatchState(model.config, ["a", "b"], mask.clone()), x))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    for part, (a, b) in zip(parts, cuts, strict=True):
        expected = (b - a) * layer + embedding.numel() * embedding.element_size() * (
            part.is_first or part.is_last
        )
        expected += sum(p.numel() * p.element_size() for p in model.model.norm.parameters()) * part.is_last
        assert part.param_bytes() == expected
    assert parts[0].param_bytes() <= total
