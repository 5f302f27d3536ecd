"""ModelProfile: shapes, bytes, dtypes, sparse embeddings, tied and frozen parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.analysis import ModelProfile, ParamInfo, analyze, named_trainable_parameters


class Zoo(nn.Module):
    """One of everything the profile has to tell apart, in a known registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse_emb = nn.Embedding(100, 8, sparse=True)
        self.bag = nn.EmbeddingBag(50, 8, sparse=True, mode="sum")
        self.dense_emb = nn.Embedding(30, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4).double())
        self.scale = nn.Parameter(torch.ones(()))  # a scalar
        self.fp16 = nn.Parameter(torch.zeros(3, 5, dtype=torch.float16))
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.dense_emb.weight  # tied: counted once, under the first name


# model.named_parameters() order: a module's own parameters first, then its children's.
ORDER = ["scale", "fp16", "sparse_emb.weight", "bag.weight", "dense_emb.weight",
         "body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    return analyze(Zoo())


def test_parameter_order_is_named_parameters_order(profile: ModelProfile) -> None:
    assert profile.names == ORDER
    assert profile.names == [n for n, p in Zoo().named_parameters() if p.requires_grad]
    assert [n for n, _ in named_trainable_parameters(Zoo())] == ORDER
    assert [profile.index(n) for n in ORDER] == list(range(len(ORDER)))


@pytest.mark.parametrize(
    ("name", "shape", "dtype", "nbytes", "module_type"),
    [
        ("sparse_emb.weight", (100, 8), "float32", 3200, "Embedding"),
        ("bag.weight", (50, 8), "float32", 1600, "EmbeddingBag"),
        ("dense_emb.weight", (30, 8), "float32", 960, "Embedding"),
        ("body.0.weight", (16, 8), "float32", 512, "Linear"),
        ("body.0.bias", (16,), "float32", 64, "Linear"),
        ("body.2.weight", (4, 16), "float64", 512, "Linear"),
        ("body.2.bias", (4,), "float64", 32, "Linear"),
        ("scale", (), "float32", 4, "Zoo"),
        ("fp16", (3, 5), "float16", 30, "Zoo"),
    ],
)
def test_shapes_bytes_dtypes(
    profile: ModelProfile, name: str, shape: tuple, dtype: str, nbytes: int, module_type: str
) -> None:
    info = profile.get(name)
    assert info.shape == shape and isinstance(info.shape, tuple)
    assert info.dtype == dtype
    assert info.numel == (torch.Size(shape).numel())
    assert info.bytes == nbytes
    assert info.module_type == module_type


@pytest.mark.parametrize(
    ("name", "sparse", "embedding_like"),
    [
        ("sparse_emb.weight", True, True),
        ("bag.weight", True, True),
        ("dense_emb.weight", False, True),
        ("body.0.weight", False, False),
        ("scale", False, False),
    ],
)
def test_sparse_detection(profile: ModelProfile, name: str, sparse: bool,
                          embedding_like: bool) -> None:
    info = profile.get(name)
    assert (info.sparse, info.embedding_like) == (sparse, embedding_like)


def test_totals_count_tied_once_and_skip_frozen(profile: ModelProfile) -> None:
    expected = 3200 + 1600 + 960 + 512 + 64 + 512 + 32 + 4 + 30
    assert profile.total_bytes == expected
    assert profile.sparse_bytes == 3200 + 1600
    assert profile.dense_bytes == expected - 4800
    assert profile.num_params == sum(p.numel for p in profile.params)
    assert profile.summary() == (
        f"9 trainable parameters ({profile.num_params:,} values, "
        f"{expected / 2**20:.1f} MiB; 2 with sparse access: 2 declared sparse, "
        "0 embedding lookups), 2 frozen")  # dense_emb is tied to head: every row written


def test_summary_counts_sparse_access_as_the_plans_do() -> None:
    """Issue 49: TinyLM's profile said "0 sparse" while Parallax's plan sent its embedding
    as sparse rows. The summary counts what the strategies treat as sparse (declared
    sparse, or an untied embedding read by lookups), each kind named, and, once
    calibrated, what measurement found."""
    from stratagem.analysis.profile import AccessStats

    model = nn.Sequential(nn.Embedding(40, 4), nn.Linear(4, 40))
    p = analyze(model)
    assert [i.sparse_access for i in p.params] == [True, False, False]
    assert "1 with sparse access: 0 declared sparse, 1 embedding lookup)" in p.summary()
    measured = p.with_access([AccessStats("1.weight", rows=40, rows_touched=5.0)])
    assert ("2 with sparse access: 0 declared sparse, 1 embedding lookup, 1 found by "
            "calibration)") in measured.summary()


def test_tied_parameter_counted_once_with_aliases(profile: ModelProfile) -> None:
    info = profile.get("dense_emb.weight")
    assert info.aliases == ("head.weight",)
    assert profile.get("head.weight") is info
    assert profile.index("head.weight") == ORDER.index("dense_emb.weight")
    assert "head.weight" not in profile.names
    assert sum(p.name == "dense_emb.weight" for p in profile.params) == 1
    assert all(p.aliases == () for p in profile.params if p is not info)


def test_frozen_excluded(profile: ModelProfile) -> None:
    assert profile.frozen == ("frozen.weight", "frozen.bias")
    for name in profile.frozen:
        assert name not in profile.names
        with pytest.raises(KeyError):
            profile.get(name)


def test_unknown_name_is_key_error(profile: ModelProfile) -> None:
    with pytest.raises(KeyError):
        profile.get("nope")
    with pytest.raises(KeyError):
        profile.index("nope")


class SparseTiedToLinear(nn.Module):
    def __init__(self, embedding_first: bool) -> None:
        super().__init__()
        if embedding_first:
            self.emb = nn.Embedding(10, 4, sparse=True)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
        else:
            self.head = nn.Linear(4, 10, bias=False)
            self.emb = nn.Embedding(10, 4, sparse=True)
            self.emb.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


@pytest.mark.parametrize("embedding_first", [True, False])
def test_sparse_embedding_tied_to_linear_is_dense(embedding_first: bool) -> None:
    # The Linear contributes a dense gradient, so the accumulated gradient is dense:
    # the profile must not promise sparse rows, whichever module was registered first.
    model = SparseTiedToLinear(embedding_first)
    (info,) = analyze(model).params
    model(torch.tensor([1, 2])).sum().backward()
    assert info.sparse is model.emb.weight.grad.is_sparse is False
    assert info.embedding_like and len(info.aliases) == 1


def test_two_sparse_embeddings_sharing_a_table_stay_sparse() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Embedding(10, 4, sparse=True)
            self.b = nn.Embedding(10, 4, sparse=True)
            self.b.weight = self.a.weight

    (info,) = analyze(Shared()).params
    assert info.sparse and info.aliases == ("b.weight",)


def test_sparse_gradient_matches_profile() -> None:
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1))
    profile = analyze(model)
    model(torch.tensor([[1, 3]])).sum().backward()
    for name, p in model.named_parameters():
        assert profile.get(name).sparse == p.grad.is_sparse


def test_param_info_to_dict() -> None:
    info = analyze(nn.Linear(2, 3)).get("weight")
    assert info.to_dict() == {
        "name": "weight", "shape": (3, 2), "dtype": "float32", "numel": 6, "bytes": 24,
        "sparse": False, "aliases": (), "module_type": "Linear", "embedding_like": False}
    assert ParamInfo(**info.to_dict()) == info


def test_fully_frozen_model() -> None:
    model = nn.Linear(2, 2).requires_grad_(False)
    profile = analyze(model)
    assert profile.params == () and profile.frozen == ("weight", "bias")
    assert profile.total_bytes == 0 and named_trainable_parameters(model) == []
