"""A strategy as a picture: one rectangle per parameter (or partition part), area
proportional to its bytes, coloured by how its gradient is synchronized, grouped into one
outlined block per all-reduce group or parameter server. ``stratagem plan --picture``.

It draws the strategy's compiled plan (:meth:`Plan.routes`), the same one the runtime
executes and ``stratagem plan`` lists, so picture, table and list cannot disagree. A pure
function of ``(Strategy, ModelProfile)``: it reads no environment and trains nothing, so
the picture of a saved strategy is the same wherever it is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stratagem.analysis import ModelProfile
from stratagem.errors import StratagemError
from stratagem.runtime.plan import Plan, Route, compile_plan
from stratagem.strategy import Strategy

# One colour per synchronizer kind (tests find them by pixel colour).
KIND_COLOURS = {"all-reduce": "#1f77b4",  # tab:blue
                "gathered rows": "#9467bd",  # tab:purple
                "PS": "#ff7f0e",  # tab:orange
                "PS sparse rows": "#2ca02c",  # tab:green
                "sharded": "#d62728",  # tab:red
                "none": "#7f7f7f"}
KIND_TEXT = {"all-reduce": "all-reduce (every replica sums the gradient)",
             "gathered rows": "rows all-gathered (each replica sends the rows it touched; "
                              "every replica sums them)",
             "PS": "parameter server (dense)",
             "PS sparse rows": "parameter server, sparse rows (only looked-up rows travel)",
             "sharded": "sharded (ZeRO: optimizer state, + gradients at stage 2, "
                        "+ parameters at stage 3)",
             "none": "no synchronizer"}
FAMILY_NAMES = {"all-reduce": "all-reduce groups", "gathered rows": "gathered-rows groups"}
MIN_SHARE = 0.006  # smaller rectangles are drawn at this share of the area, to stay visible
MIN_BLOCK_SHARE = 0.02  # and a group or server block at this share
MAX_BLOCKS = 24  # all-reduce groups / servers drawn as their own block; the rest merged
MAX_PER_BLOCK = 40  # tensors drawn one by one in a block; the rest merged
SMALL_SHARE = 0.002  # tensors under this share of the model's bytes join "N small tensors"
WIDTH_PX, HEIGHT_PX = 1400, 820  # the treemap's area; the figure adds title and legend
HEADER_PX = 16  # a block's label strip (a block shorter than 3 strips goes without)


@dataclass(frozen=True)
class Leaf:
    """One rectangle's worth: a parameter, a partition part, or merged small tensors."""

    label: str
    detail: str
    nbytes: int
    kind: str
    count: int = 1


@dataclass
class Block:
    """The tensors one synchronizer unit handles: an all-reduce group or one server."""

    key: tuple[str, str]
    title: str
    leaves: list[Leaf]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def count(self) -> int:
        return sum(leaf.count for leaf in self.leaves)


def human_bytes(n: float) -> str:
    """``n`` bytes in B/KiB/MiB/GiB with three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def _percent(part: float, whole: float) -> str:
    pct = 100 * part / max(whole, 1)
    return f"{pct:.0f}%" if pct >= 1 or pct == 0 else f"{pct:.2g}%"


def _block_of(route: Route, replicas: tuple[str, ...], plan: Plan
              ) -> tuple[tuple[str, str], str]:
    """(block key, block title) of one piece: its all-reduce group or its server."""
    if route.kind == "all-reduce":
        extra = "" if route.how == "none" else f", {route.how}"
        return ("all-reduce", f"group {route.unit}"), f"all-reduce group {route.unit}{extra}"
    if route.kind == "gathered rows":
        return (("gathered rows", f"group {route.unit}"),
                f"rows all-gathered (group {route.unit})")
    if route.kind == "sharded":
        if route.unit < 0:
            unit = route.destination or "(root)"
            return ("sharded", f"unit {unit}"), f"sharded stage 3, FSDP2 unit {unit}"
        return (("sharded", f"rank {route.unit}"),
                f"sharded {route.how}: updated by rank {route.unit}")
    dest = route.destination
    where = f"worker {replicas.index(dest)}" if dest in replicas else "server"
    ps = plan.ps
    mode = "sync" if ps is None or ps.mode == "bsp" else ps.mode
    return ("PS", dest), f"PS on {dest} ({where}, {mode})"


def collect_blocks(strategy: Strategy, profile: ModelProfile, plan: Plan | None = None
                   ) -> list[Block]:
    """The pieces of the strategy's compiled ``plan`` (compiled here when not given) grouped
    by synchronizer unit, largest block first."""
    for nc in strategy.node_config:
        try:
            profile.get(nc.var_name)
        except KeyError:
            raise StratagemError(f"parameter {nc.var_name!r} of the strategy is not in the "
                                 "model", where=f"strategy {strategy.id}",
                                 fix="draw the strategy with the model it was built for"
                                 ) from None
    replicas = tuple(strategy.graph_config.replicas)
    if plan is None:
        plan = compile_plan(strategy, profile, rank=0, world_size=max(len(replicas), 1),
                            device=torch.device("cpu"))
    blocks: dict[tuple[str, str], Block] = {}
    for r in plan.routes():
        full = profile.get(r.param).shape
        shape = "×".join(str(d) for d in full) or "scalar"
        if r.axis is None:
            label, detail = r.param, f"[{shape}]"
        else:
            what = "rows" if r.axis == 0 else f"axis {r.axis}"
            label = f"{r.param}/part_{r.part}"
            detail = f"{what} {r.start}-{r.start + r.length - 1} of [{shape}]"
        key, title = _block_of(r, replicas, plan)
        blocks.setdefault(key, Block(key, title, [])).leaves.append(
            Leaf(label, detail, r.nbytes, r.kind))
    return sorted(blocks.values(), key=lambda b: -b.nbytes)


def _merge_tail(blocks: list[Block], total: int) -> list[Block]:
    """At most MAX_BLOCKS blocks, each with at most MAX_PER_BLOCK named tensors."""
    blocks = [Block(b.key, b.title, list(b.leaves)) for b in blocks]  # the caller's stay whole
    kept, extra = blocks[:MAX_BLOCKS - 1], blocks[MAX_BLOCKS - 1:]
    if len(extra) > 1:
        merged: dict[str, Block] = {}
        for b in extra:
            family = b.key[0]
            m = merged.setdefault(family, Block(("more", family), "", []))
            m.leaves.extend(b.leaves)
            n = sum(x.key[0] == family for x in extra)
            m.title = f"{n} more {FAMILY_NAMES.get(family, 'servers')}"
        kept += list(merged.values())
    else:
        kept += extra
    for b in kept:
        leaves = sorted(b.leaves, key=lambda leaf: -leaf.nbytes)
        named = [leaf for i, leaf in enumerate(leaves)
                 if i < MAX_PER_BLOCK and leaf.nbytes >= SMALL_SHARE * total]
        rest = leaves[len(named):]
        if len(rest) > 1:  # one merged rectangle per kind, so colours keep their areas
            for kind in dict.fromkeys(leaf.kind for leaf in rest):
                same = [leaf for leaf in rest if leaf.kind == kind]
                n = sum(leaf.count for leaf in same)
                named.append(Leaf(f"{n} small tensor{'s' * (n != 1)}", "",
                                  sum(leaf.nbytes for leaf in same), kind, n))
        else:
            named += rest
        b.leaves = sorted(named, key=lambda leaf: -leaf.nbytes)
    return sorted(kept, key=lambda b: -b.nbytes)


Rect = tuple[float, float, float, float]  # x, y, width, height (pixels, y up)


def _worst(row: list[float], side: float) -> float:
    """The most elongated aspect ratio of ``row`` laid along a side of length ``side``."""
    total = sum(row)
    return max(max(side * side * r / (total * total), total * total / (side * side * r))
               for r in row)


def treemap(weights: list[float], rect: Rect) -> list[Rect]:
    """Rectangles tiling ``rect`` with areas proportional to ``weights`` (sorted largest
    first, all > 0), in order. Squarified: fill a strip along the shorter side while adding
    the next weight makes the strip's worst aspect ratio no worse (Bruls, Huizing and van
    Wijk, 2000), so small tensors get squares rather than slivers."""
    x, y, w, h = rect
    scale = w * h / (sum(weights) or 1.0)
    areas = [wt * scale for wt in weights]
    out: list[Rect] = []
    i = 0
    while i < len(areas):
        side = min(w, h) or 1e-9
        row = [areas[i]]
        i += 1
        while i < len(areas) and _worst(row + [areas[i]], side) <= _worst(row, side):
            row.append(areas[i])
            i += 1
        thick = sum(row) / side
        if w >= h:  # a column at the left, filled top to bottom
            top = y + h
            for a in row:
                out.append((x, top - a / thick, thick, a / thick))
                top -= a / thick
            x, w = x + thick, max(w - thick, 0.0)
        else:  # a row at the top, filled left to right
            left = x
            for a in row:
                out.append((left, y + h - thick, a / thick, thick))
                left += a / thick
            h = max(h - thick, 0.0)
    return out


CHAR_EM = 0.62  # DejaVu Sans's mean character width, in ems
PX_PER_PT = 100 / 72  # the figure's dpi over 72 points per inch


def elide(text: str, chars: int) -> str | None:
    """``text`` in at most ``chars`` characters, or None. A dotted name loses its words
    from the middle first (``encoder…12…in_proj_weight``): the numbers that say which
    layer, and the last word that says which tensor, go last; anything else loses its
    middle characters."""
    if len(text) <= chars:
        return text
    if chars < 6:
        return None
    words = text.split(".")
    if len(words) > 2:
        keep = {0, len(words) - 1} | {i for i, w in enumerate(words) if w.isdigit()}
        # The words before the first number go first (the nearest to it first, so the
        # name's first word stays longest), then those after it from the middle out.
        first = next((i for i in sorted(keep) if words[i].isdigit()), len(words) - 1)
        before = [i for i in range(first - 1, 0, -1) if i not in keep] + [0]
        after = [i for i in range(first + 1, len(words) - 1) if i not in keep]
        gone: set[int] = set()
        for i in before + after:
            gone.add(i)
            shown, prev = "", False
            for j, w in enumerate(words):
                if j in gone:
                    shown += "" if prev else "…"
                    prev = True
                else:
                    shown += w if prev or j == 0 else "." + w
                    prev = False
            if len(shown) <= chars:
                return shown
        head = shown[:len(shown) - len(words[-1])]  # "…12…": the numbers, then the end
        if chars - len(head) >= 2:
            return head + words[-1][len(words[-1]) - (chars - len(head)):]
    tail = (chars - 1) // 2
    return text[:chars - 1 - tail] + "…" + text[len(text) - tail:]


def _fit(text: str, width_px: float, size: float) -> str | None:
    """``text`` shortened (:func:`elide`) to fit ``width_px`` at font ``size``, or None."""
    return elide(text, int(width_px / (size * CHAR_EM * PX_PER_PT)) - 1)


def draw_strategy(strategy: Strategy, profile: ModelProfile, model_name: str = "",
                  plan: Plan | None = None) -> Any:
    """A matplotlib ``Figure`` of the strategy as ``plan`` (its compiled plan, compiled here
    when not given) runs it (see the module docstring)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise StratagemError("drawing a strategy needs matplotlib", where="--picture",
                             fix="pip install matplotlib (or pip install 'stratagem[plot]')"
                             ) from None
    all_blocks = collect_blocks(strategy, profile, plan)
    total = sum(b.nbytes for b in all_blocks)
    blocks = _merge_tail(all_blocks, total)
    # Display weights: bytes, with a floor so a small tensor or group stays visible.
    floor = min(MIN_SHARE, 0.25 / max(sum(len(b.leaves) for b in blocks), 1)) * total
    shown = [[max(float(leaf.nbytes), floor, 1.0) for leaf in b.leaves] for b in blocks]
    block_floor = min(MIN_BLOCK_SHARE, 0.3 / max(len(blocks), 1)) * sum(map(sum, shown))
    shown = [[w * max(1.0, block_floor / sum(ws)) for w in ws] for ws in shown]
    dpi, top, bottom = 100, 64, 96  # pixels above (titles) and below (legend) the map
    height = HEIGHT_PX + top + bottom
    fig = Figure(figsize=(WIDTH_PX / dpi, height / dpi), dpi=dpi)
    ax = fig.add_axes((0.0, bottom / height, 1.0, HEIGHT_PX / height))
    ax.set_xlim(0, WIDTH_PX)
    ax.set_ylim(0, HEIGHT_PX)
    ax.set_axis_off()
    pad = 3.0
    order = sorted(range(len(blocks)), key=lambda i: -sum(shown[i]))
    rects = treemap([sum(shown[i]) for i in order], (0, 0, WIDTH_PX, HEIGHT_PX))
    for i, (bx, by, bw, bh) in zip(order, rects, strict=True):
        block = blocks[i]
        inner = (bx + pad, by + pad, max(bw - 2 * pad, 0.5), max(bh - 2 * pad, 0.5))
        count = f"{block.count} tensor{'s' * (block.count != 1)}"
        # A strip for the block's name where it fits (the longest telling that does, bold
        # text is wider); else the tensors' own labels say enough.
        title = next((t for t in (f"{block.title} · {count} · {human_bytes(block.nbytes)}",
                                  f"{block.title} · {human_bytes(block.nbytes)}", block.title)
                      if _fit(t, inner[2] - 6, 7.2) == t), None)
        header = HEADER_PX if inner[3] >= 3 * HEADER_PX and title else 0
        if header and title:
            label = ax.text(inner[0] + 3, inner[1] + inner[3] - header / 2, title, fontsize=8,
                    va="center", ha="left", fontweight="bold", color="#222222")
            label.set_clip_path(Rectangle(inner[:2], inner[2], inner[3],
                                          transform=ax.transData))
        area = (inner[0], inner[1], inner[2], inner[3] - header)
        for leaf, (lx, ly, lw, lh) in zip(block.leaves, treemap(shown[i], area),
                                          strict=True):
            merged = leaf.count > 1
            patch = ax.add_patch(Rectangle((lx, ly), lw, lh,
                                           facecolor=KIND_COLOURS[leaf.kind],
                                           edgecolor="white", linewidth=0.6,
                                           hatch="." if merged else None))
            lines = [leaf.label, leaf.detail, human_bytes(leaf.nbytes)]
            fitted = [_fit(t, lw, 7) for t in lines if t]
            text = [t for t in fitted if t][: max(int(lh // 11), 0)]
            if text and fitted[0]:
                ax.text(lx + lw / 2, ly + lh / 2, "\n".join(text), fontsize=7, ha="center",
                        va="center", color="white", clip_on=True).set_clip_path(patch)
        # The block's outline: group and server boundaries stay visible between tensors.
        ax.add_patch(Rectangle(inner[:2], inner[2], inner[3], fill=False,
                               edgecolor="#222222", linewidth=1.4))
    replicas = len(strategy.graph_config.replicas)
    head = f"{model_name} — " if model_name else ""
    fig.text(0.5, 1 - 8 / height, f"{head}strategy {strategy.name} ({strategy.id}), "
             f"{replicas or '?'} replica{'s' * (replicas != 1)}", fontsize=13, ha="center",
             va="top")
    fig.text(0.5, 1 - 34 / height,
             f"{len(profile.params)} trainable parameters, {human_bytes(total)}. Area ∝ bytes "
             "(small ones enlarged to stay visible); one outlined "
             "block per all-reduce group or parameter server; dotted = small tensors merged",
             ha="center", va="top", fontsize=9, color="#444444")
    by_kind: dict[str, list[Leaf]] = {}
    units: dict[str, set[tuple[str, str]]] = {}
    for b in all_blocks:
        for leaf in b.leaves:
            by_kind.setdefault(leaf.kind, []).append(leaf)
            units.setdefault(leaf.kind, set()).add(b.key)
    handles = []
    for k in KIND_COLOURS:
        if k not in by_kind:
            continue
        nbytes = sum(leaf.nbytes for leaf in by_kind[k])
        n = len(units[k])
        unit = ("group" if k in ("all-reduce", "gathered rows") else "server"
                if k.startswith("PS") else "owner or unit" if k == "sharded" else "block")
        handles.append(Patch(facecolor=KIND_COLOURS[k], edgecolor="#222222",
                             label=f"{KIND_TEXT[k]}: {len(by_kind[k])} "
                                   f"tensor{'s' * (len(by_kind[k]) != 1)}, "
                                   f"{human_bytes(nbytes)} ({_percent(nbytes, total)}"
                                   f"), {n} {unit}{'s' * (n != 1)}"))
    fig.legend(handles=handles, loc="lower center", ncol=1 if len(handles) < 2 else 2,
               fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig


def save_picture(strategy: Strategy, profile: ModelProfile, path: str | Path,
                 model_name: str = "", plan: Plan | None = None) -> Path:
    """Draw the strategy and write it to ``path`` (format from the suffix: .png, .svg, .pdf)."""
    out = Path(path)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise StratagemError(f"cannot tell the picture format of {str(out)!r}",
                             where="--picture", fix="name the file .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise StratagemError(f"directory {str(out.parent)!r} does not exist",
                             where="--picture", fix="create it or pick another path")
    fig = draw_strategy(strategy, profile, model_name, plan)
    try:
        fig.savefig(out)
    except OSError as exc:
        raise StratagemError(f"cannot write the picture: {exc}", where=str(out),
                             fix="pick a writable path") from None
    return out
