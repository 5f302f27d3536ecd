"""``stratagem plan --picture``: the strategy drawn as a treemap. The pictures are read back
as pixels: each synchronizer kind's colour covers a share of the map close to its share of
the model's bytes."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402

from stratagem.analysis import ModelProfile, ParamInfo, analyze  # noqa: E402
from stratagem.cli import main  # noqa: E402
from stratagem.cli.plan import load_model  # noqa: E402
from stratagem.cli.plan_picture import (  # noqa: E402
    KIND_COLOURS,
    MAX_BLOCKS,
    MAX_PER_BLOCK,
    collect_blocks,
    draw_strategy,
    elide,
    save_picture,
    treemap,
)
from stratagem.errors import StratagemError  # noqa: E402
from stratagem.resource import ResourceSpec  # noqa: E402
from stratagem.strategy import (  # noqa: E402
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    PSSynchronizer,
    Strategy,
    resolve_builder,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models.py"
REPLICAS = ("127.0.0.1:CPU:0", "127.0.0.1:CPU:1")


def _pixels(png: Path, kind: str) -> int:
    image = mpimg.imread(png)[..., :3]
    colour = np.array([int(KIND_COLOURS[kind][i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(image - colour).max(axis=-1) < 0.02).sum())


def _mixed_mlp() -> tuple[Strategy, ModelProfile]:
    """examples/models.py:mlp with its largest weight on a parameter server, the rest
    all-reduced in two groups."""
    profile = analyze(load_model(f"{MODELS}:mlp"))
    nodes = tuple(NodeConfig(p.name, PSSynchronizer(reduction_destination=REPLICAS[1]))
                  if p.name == "2.weight" else
                  NodeConfig(p.name, AllReduceSynchronizer(group=i % 2))
                  for i, p in enumerate(profile.params))
    return Strategy(nodes, GraphConfig(REPLICAS), builder="mixed"), profile


def test_mixed_strategy_colours_in_proportion_to_bytes(tmp_path: Path) -> None:
    strategy, profile = _mixed_mlp()
    png = save_picture(strategy, profile, tmp_path / "mixed.png", model_name="mlp")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ps_bytes = profile.get("2.weight").bytes
    expected = ps_bytes / profile.total_bytes  # 64 KiB of 81.5 KiB
    blue, orange = _pixels(png, "all-reduce"), _pixels(png, "PS")
    assert _pixels(png, "PS sparse rows") == 0
    assert blue > 10_000 and orange > 10_000
    assert orange / (blue + orange) == pytest.approx(expected, abs=0.03)
    # Two all-reduce groups and one server: three blocks, each tensor exactly once.
    blocks = collect_blocks(strategy, profile)
    assert sorted(b.title for b in blocks) == ["PS on 127.0.0.1:CPU:1 (worker 1, sync)",
                                               "all-reduce group 0", "all-reduce group 1"]
    assert sum(b.nbytes for b in blocks) == profile.total_bytes


def test_parallax_recommender_shows_sparse_rows_per_server(tmp_path: Path) -> None:
    profile = analyze(load_model(f"{MODELS}:Recommender"))
    spec = ResourceSpec.local(2)
    strategy = resolve_builder("Parallax").build(profile, spec)
    png = save_picture(strategy, profile, tmp_path / "parallax.png")
    green, blue = _pixels(png, "PS sparse rows"), _pixels(png, "all-reduce")
    # The table (12.2 MiB) dwarfs the dense tower (8.5 KiB), which still stays visible.
    assert green > 50 * blue > 0
    assert _pixels(png, "PS") == 0
    titles = [b.title for b in collect_blocks(strategy, profile)]
    assert sum(t.startswith("PS on ") for t in titles) == 2  # the table split over both


def test_hundreds_of_tensors_stay_bounded_and_merge_the_tail() -> None:
    rng = random.Random(7)
    params = tuple(ParamInfo(f"layer{i}.w", (n,), "float32", n, 4 * n)
                   for i, n in enumerate(rng.choice([4, 64, 4096, 100_000])
                                         for _ in range(600)))
    profile = ModelProfile(params)
    nodes = tuple(NodeConfig(p.name, AllReduceSynchronizer(group=i // 10))
                  for i, p in enumerate(params))  # 60 groups
    fig = draw_strategy(Strategy(nodes, GraphConfig(REPLICAS), builder="many"), profile)
    ax = fig.axes[0]
    assert len(ax.patches) <= (MAX_BLOCKS + 1) * (MAX_PER_BLOCK + 2)
    texts = [t.get_text() for t in ax.texts]
    assert any("small tensors" in t for t in texts)
    assert any(t.startswith("37 more all-reduce groups") for t in texts)
    legend = fig.legends[0].get_texts()[0].get_text()
    assert "600 tensors" in legend and "60 groups" in legend


def test_treemap_tiles_the_rectangle_in_proportion() -> None:
    rng = random.Random(3)
    weights = sorted((rng.uniform(0.01, 10) for _ in range(50)), reverse=True)
    rects = treemap(weights, (10, 20, 300, 200))
    areas = [w * h for _, _, w, h in rects]
    assert sum(areas) == pytest.approx(300 * 200)
    for area, weight in zip(areas, weights, strict=True):
        assert area == pytest.approx(300 * 200 * weight / sum(weights))
    eps = 1e-6
    for i, (x, y, w, h) in enumerate(rects):  # inside the rectangle, and no overlaps
        assert x >= 10 - eps and x + w <= 310 + eps and y >= 20 - eps and y + h <= 220 + eps
        for x2, y2, w2, h2 in rects[i + 1:]:
            overlap = (max(0.0, min(x + w, x2 + w2) - max(x, x2))
                       * max(0.0, min(y + h, y2 + h2) - max(y, y2)))
            assert overlap < eps


def test_cli_picture_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "s.png"
    assert main(["plan", "--model", f"{MODELS}:small_mlp", "--resource-spec",
                 str(ROOT / "examples" / "specs" / "two-node.yml"), "--strategy",
                 str(ROOT / "examples" / "strategies" / "mlp-mixed.yaml"),
                 "--picture", str(out)]) == 0
    assert f"picture saved to {out}" in capsys.readouterr().out
    assert _pixels(out, "PS") > _pixels(out, "all-reduce") > 0
    assert main(["plan", "--model", f"{MODELS}:mlp", "--picture",
                 str(tmp_path / "s.gif")]) == 2
    assert "name the file .png, .svg or .pdf" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    with pytest.raises(StratagemError, match="pip install matplotlib"):
        draw_strategy(*_mixed_mlp())


def test_a_strategy_for_another_model_is_a_clear_error() -> None:
    strategy, _ = _mixed_mlp()
    other = analyze(load_model(f"{MODELS}:Recommender"))
    with pytest.raises(StratagemError, match="not in the model"):
        draw_strategy(strategy, other)


def test_long_names_lose_their_middle_not_the_layer_number() -> None:
    """Issue 49: names were cut from the left ("…r1.weight"), losing the layer number, and
    ran past their rectangles. The middle goes instead, and every label fits its box."""
    profile = analyze(load_model(f"{MODELS}:TinyLM"))
    spec = ResourceSpec.from_file(ROOT / "examples" / "specs" / "two-node.yml")
    fig = draw_strategy(resolve_builder("Parallax").build(profile, spec), profile)
    ax = fig.axes[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [p.get_window_extent(renderer) for p in ax.patches if p.get_fill()]
    labels = [t for t in ax.texts if t.get_fontsize() == 7]
    assert len(labels) > 50
    elided = 0
    for t in labels:
        name = t.get_text().split("\n")[0]
        box = t.get_window_extent(renderer)
        home = [b for b in boxes if b.x0 - 1 <= (box.x0 + box.x1) / 2 <= b.x1 + 1
                and b.y0 - 1 <= (box.y0 + box.y1) / 2 <= b.y1 + 1]
        assert home and min(b.width for b in home) >= box.width, name  # fits its box
        merged = re.match(r"\d+ ", name)  # "46 small tensors"
        if "…" in name and not merged and "embedding" not in name and len(name) > 5:
            elided += 1
            layer = re.search(r"(\d+)", name)
            assert layer and f"layers.{layer.group(1)}." in " ".join(
                p.name for p in profile.params), name
            end = name.rsplit("…", 1)[1]  # the name's own end, kept
            assert any(p.name.endswith(end) and layer.group(1) in p.name
                       for p in profile.params), name
    assert elided > 20


def testelide_keeps_numbers_and_the_last_word() -> None:
    name = "encoder.layers.12.self_attn.in_proj_weight"
    assert elide(name, 99) == name
    assert elide(name, 20) == "…12…in_proj_weight"
    assert elide("encoder.layers.3.linear2.weight", 20) == "…3.linear2.weight"
    assert elide("a_rather_long_plain_name", 12) == "a_rath…_name"
    assert all(len(elide(name, n) or "") <= n for n in range(1, 45))
