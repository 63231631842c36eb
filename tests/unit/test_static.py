"""The decode step over fixed shapes (`app.partitions.static`) against the eager step.

On a CPU the static layout runs eagerly (mode "eager", what a CUDA graph captures): greedy tokens
identical to `StagePartition.forward`'s in fp32 over steps that reallocate the cache, drop finished
rows and absorb a joining batch. With a GPU, the same with captured graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.static import StaticDecode, mode_for

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def prompts(rows: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (rows,), generator=generator).tolist()
    return [torch.randint(3, 60, (n,), generator=generator).tolist() for n in lengths]


class Pair:
    """The same batch on an eager stage and a static one, stepped together."""

    def __init__(self, eager: StagePartition, fixed: StagePartition, rows: int, seed: int) -> None:
        self.eager, self.fixed = eager, fixed
        ids, mask = left_pad(prompts(rows, seed), 0)
        seq_ids = [f"{seed}-{i}" for i in range(rows)]
        self.a = BatchState(eager.config, seq_ids, mask)
        self.b = BatchState(fixed.config, seq_ids, mask)
        with torch.inference_mode():
            self.tokens = eager(self.a, ids).argmax(-1)
            assert torch.equal(self.tokens, fixed(self.b, ids).argmax(-1))

    def step(self) -> tuple[list[int], list[int]]:
        self.a.extend(1)
        self.b.extend(1)
        feed = self.tokens[:, None]
        with torch.inference_mode():
            eager, fixed = self.eager(self.a, feed).argmax(-1), self.fixed(self.b, feed).argmax(-1)
        self.tokens = eager
        return eager.tolist(), fixed.tolist()

    def keep(self, rows: list[int]) -> None:
        seq_ids = [self.a.seq_ids[r] for r in rows]
        self.a.keep(seq_ids)
        self.b.keep(seq_ids)
        self.tokens = self.tokens[rows]

    def absorb(self, other: Pair) -> None:
        self.a.absorb(other.a)
        self.b.absorb(other.b)
        self.tokens = torch.cat([self.tokens, other.tokens])


def stages(path: Path, mode: str, device: str = "cpu") -> tuple[StagePartition, StagePartition]:
    eager = StagePartition.load(path, device=device)
    fixed = StagePartition.load(path, device=device)
    fixed.static = StaticDecode(fixed, mode)
    return eager, fixed


def run_story(eager: StagePartition, fixed: StagePartition) -> int:
    """Steps past a reallocation, a finished row and a joining batch; returns the static steps taken."""
    taken = 0
    original = fixed.static
    assert original is not None

    def counted(state: BatchState, x: torch.Tensor) -> torch.Tensor:
        nonlocal taken
        taken += 1
        return original(state, x)

    fixed.static = _Counting(original, counted)
    pair = Pair(eager, fixed, rows=3, seed=1)
    for _ in range(70):  # past the 64 spare columns of the first buffer: it is reallocated
        a, b = pair.step()
        assert a == b
    pair.keep([0, 2])
    for _ in range(3):
        a, b = pair.step()
        assert a == b
    pair.absorb(Pair(eager, fixed, rows=2, seed=2))
    for _ in range(5):
        a, b = pair.step()
        assert a == b
    fixed.static = original
    return taken


class _Counting:
    def __init__(self, inner: StaticDecode, call: object) -> None:
        self.inner, self.call = inner, call

    def handles(self, state: BatchState, x: torch.Tensor) -> bool:
        return self.inner.handles(state, x)

    def __call__(self, state: BatchState, x: torch.Tensor) -> torch.Tensor:
        return self.call(state, x)  # type: ignore[operator,no-any-return]


def test_the_static_layout_chooses_the_eager_tokens(tiny_model: Path) -> None:
    eager, fixed = stages(tiny_model, "eager")
    assert run_story(eager, fixed) == 78  # every decode step went through the static step


def test_a_middle_stage_hands_on_the_same_hidden_states(tiny_model: Path) -> None:
    eager = StagePartition.load(tiny_model, LayerRange(1, 3))
    fixed = StagePartition.load(tiny_model, LayerRange(1, 3))
    fixed.static = StaticDecode(fixed, "eager")
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    hidden = torch.randn(2, 4, eager.config.hidden_size, generator=torch.Generator().manual_seed(0))
    a, b = BatchState(eager.config, ["x", "y"], mask), BatchState(fixed.config, ["x", "y"], mask)
    with torch.inference_mode():
        eager(a, hidden)
        fixed(b, hidden)
        for _ in range(3):
            a.extend(1)
            b.extend(1)
            new = torch.randn(2, 1, eager.config.hidden_size)
            torch.testing.assert_close(fixed(b, new), eager(a, new), rtol=1e-3, atol=1e-3)


def test_prefill_and_sliding_layers_stay_eager(tiny_model: Path, family_models: dict) -> None:
    stage = StagePartition.load(tiny_model)
    static = StaticDecode(stage, "eager")
    ids, mask = left_pad(prompts(2, 3), 0)
    state = BatchState(stage.config, ["a", "b"], mask)
    assert not static.handles(state, ids)  # a prefill: no history yet, many tokens a row
    with torch.inference_mode():
        stage(state, ids)
    state.extend(1)
    assert static.handles(state, ids[:, -1:])
    gemma = StagePartition.load(family_models["gemma3"][0])
    assert not StaticDecode(gemma, "eager").handles(BatchState(gemma.config, ["a"], mask[:1]), ids[:1, -1:])


def test_the_mode_follows_the_setting_and_the_device() -> None:
    assert mode_for("auto", "cpu") == "off"
    assert mode_for("off", "cuda:0") == "off"
    assert mode_for("auto", "cuda:0") == "graphs"
    assert mode_for("off", "cuda:1") == "off"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        mode_for("graphs", "cpu")
    for unknown in ("compile", "1", "0"):
        with pytest.raises(ValueError, match="unknown compile mode"):
            mode_for(unknown, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_choose_the_eager_tokens(tiny_model: Path) -> None:
    eager, fixed = stages(tiny_model, "graphs", device="cuda")
    assert run_story(eager, fixed) == 78
    assert fixed.static is not None and 1 <= len(fixed.static.graphs) <= 8
