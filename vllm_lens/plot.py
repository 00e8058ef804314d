"""Pictures of what vllm-lens returns, as matplotlib figures (runs in: caller).

Each function takes an object vllm-lens already gives back and returns a
``matplotlib.figure.Figure`` (made without pyplot, so nothing global changes;
``fig.savefig(path)`` writes it; a notebook shows it once matplotlib's inline support is on:
``%matplotlib inline`` or ``import matplotlib.pyplot``, as in most notebooks already). Text
is drawn as it is (a ``$`` in a token is not read as mathematics):

- ``attention_pattern``: one head's pattern, or a grid of heads, tokens on both axes
  (``vllm_lens.attention.attention_patterns`` of an ``output_qk`` result);
- ``logit_lens``: layers × positions, each cell the top token and coloured by its
  probability (the named hook ``logit_lens_topk``'s ``saved``);
- ``token_scores``: the tokens coloured by a score per token (a probe's, a monitor's, an SAE
  feature's values);
- ``top_features``: the top SAE features of one position with their labels (an entry of
  ``sae_features``);
- ``logit_attribution``: the embedding's and each layer's attention and MLP direct effect on
  one position's logit (``output_logit_attribution``);
- ``side_by_side``: two generations (plain and steered) in two columns.

matplotlib is an optional dependency (the ``demo`` extra installs it).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["attention_pattern", "logit_attribution", "logit_lens", "side_by_side",
           "token_scores", "top_features"]


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - the message is the point
        raise ImportError("vllm_lens.plot needs matplotlib: pip install matplotlib (or the "
                          "'demo' extra)") from None
    return Figure(figsize=(width, height), layout="constrained")


def _values(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def attention_pattern(pattern: Any, tokens: Sequence[str], *,
                      heads: int | Sequence[int] | None = None, layer: int | None = None,
                      columns: int = 4) -> Any:
    """Attention weights with the tokens on both axes (queries down, keys across).

    Args:
        pattern: ``[n_heads, seq, seq]`` (``attention_patterns(out.activations, layer)``) or
            one head's ``[seq, seq]``.
        tokens: the ``seq`` token strings.
        heads: one head (one panel), several (a grid), or ``None``: every head (ignored
            for a one-head ``pattern``).
        layer: shown in the titles.
        columns: panels per row of a grid.

    Returns:
        A ``matplotlib.figure.Figure``.

    Examples:
        >>> import torch
        >>> from vllm_lens.plot import attention_pattern
        >>> fig = attention_pattern(torch.eye(3)[None].repeat(2, 1, 1), ["a", "b", "c"],
        ...                         heads=1, layer=4)
        >>> fig.axes[0].get_title()
        'layer 4, head 1'
    """
    rows = _values(pattern)
    if rows and rows[0] and not isinstance(rows[0][0], list):  # one head
        rows, chosen = [rows], [0]
    else:
        chosen = list(range(len(rows))) if heads is None else (
            [heads] if isinstance(heads, int) else list(heads))
    n = len(chosen)
    cols = min(columns, n)
    grid = math.ceil(n / cols)
    size = max(2.5, 0.35 * len(tokens))
    fig = _figure(size * cols, size * grid)
    for i, head in enumerate(chosen):
        ax = fig.add_subplot(grid, cols, i + 1)
        image = ax.imshow(rows[head], cmap="Blues", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=8, parse_math=False)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=8, parse_math=False)
        ax.set_title(f"{'' if layer is None else f'layer {layer}, '}head {head}")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.colorbar(image, ax=fig.axes, shrink=0.6, label="attention weight")
    return fig


def logit_lens(saved: Mapping[str, Any], tokens: Sequence[str] | None = None, *,
               decode: Callable[[int], str] | None = None) -> Any:
    """A logit-lens grid: per layer (rows) and position (columns) the top token, the cell
    coloured by its probability.

    Args:
        saved: ``logit_lens_topk``'s ``saved`` (``out.hook_results["0"]``): ``token_ids``
            and ``logprobs`` per layer ``[positions, k]``, ``positions`` per layer.
        tokens: the input token strings of those positions (the columns' labels), if given.
        decode: token id -> string (e.g. ``tokenizer.decode``); default: the id.

    Returns:
        A ``matplotlib.figure.Figure``.

    Examples:
        >>> import torch
        >>> from vllm_lens.plot import logit_lens
        >>> saved = {"token_ids": {2: torch.tensor([[7], [9]])},
        ...          "logprobs": {2: torch.tensor([[-0.1], [-2.0]])}}
        >>> [t.get_text() for t in logit_lens(saved, ["a", "b"]).axes[0].texts]
        ['7', '9']
    """
    layers = sorted(saved["token_ids"], key=int)
    ids = [[row[0] for row in _values(saved["token_ids"][layer])] for layer in layers]
    probs = [[math.exp(row[0]) for row in _values(saved["logprobs"][layer])]
             for layer in layers]
    n = len(ids[0]) if ids else 0
    positions = (_values(saved["positions"][layers[0]]) if layers and "positions" in saved
                 else list(range(n)))
    fig = _figure(max(4.0, 0.9 * n + 1.5), max(2.5, 0.35 * len(layers) + 1.2))
    ax = fig.add_subplot()
    image = ax.imshow(probs, cmap="Greens", vmin=0.0, vmax=1.0, aspect="auto")
    for r, row in enumerate(ids):
        for c, token in enumerate(row):
            text = decode(int(token)) if decode is not None else str(token)
            ax.text(c, r, text.strip() or repr(text), ha="center", va="center", fontsize=7,
                    parse_math=False)
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_ylabel("layer")
    if tokens is not None:  # a generated position past the tokens given: its number
        shown = [tokens[p] if p < len(tokens) else str(p) for p in positions]
        ax.set_xticks(range(n), shown, rotation=90, fontsize=8, parse_math=False)
    ax.set_xlabel("position (input token)")
    fig.colorbar(image, ax=ax, label="probability of the top token")
    return fig


def token_scores(tokens: Sequence[str], scores: Any, *, title: str | None = None,
                 per_line: int = 12, cmap: str = "RdBu_r") -> Any:
    """The tokens, each on a cell coloured by its score (symmetric around 0).

    Args:
        tokens: the token strings.
        scores: one number per token (a probe's scores, an SAE feature's values ...).
        title: the figure's title.
        per_line: tokens per row.
        cmap: a diverging matplotlib colormap.

    Returns:
        A ``matplotlib.figure.Figure``.

    Examples:
        >>> from vllm_lens.plot import token_scores
        >>> fig = token_scores(["The", " sea", " is"], [0.1, 2.0, -0.5], title="probe")
        >>> [t.get_text() for t in fig.axes[0].texts]
        ['The', ' sea', ' is']
    """
    values = [float(v) for v in _values(scores)]
    if len(values) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(values)} scores")
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    bound = max((abs(v) for v in values if math.isfinite(v)), default=1.0) or 1.0
    norm, colors = Normalize(-bound, bound), colormaps[cmap]
    lines = math.ceil(len(tokens) / per_line) or 1
    fig = _figure(1.0 * per_line, 0.5 * lines + (0.5 if title else 0.2))
    ax = fig.add_subplot()
    ax.set_xlim(0, per_line)
    ax.set_ylim(lines, 0)
    ax.axis("off")
    for i, (token, value) in enumerate(zip(tokens, values)):
        x, y = i % per_line, i // per_line
        face = colors(norm(value)) if math.isfinite(value) else (0.9, 0.9, 0.9, 1.0)
        ax.add_patch(_rectangle((x + 0.02, y + 0.1), 0.96, 0.8, face))
        ax.text(x + 0.5, y + 0.5, token, ha="center", va="center", fontsize=9,
                parse_math=False)
    if title:
        ax.set_title(title)
    return fig


def _rectangle(xy: tuple[float, float], width: float, height: float, color: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, width, height, color=color)


def top_features(entry: Mapping[str, Any], position: int = -1, *, k: int = 10) -> Any:
    """The top features of one position of an ``sae_features`` entry, as bars, each named by
    its label where the entry carries labels.

    Args:
        entry: one entry of ``out.sae_features`` (``indices``, ``values``, ``positions``,
            optionally ``labels``).
        position: the row (an index into ``entry["positions"]``; default the last).
        k: at most this many features.

    Returns:
        A ``matplotlib.figure.Figure``.

    Examples:
        >>> import torch
        >>> from vllm_lens.plot import top_features
        >>> entry = {"sae": "l10", "positions": torch.tensor([5]),
        ...          "indices": torch.tensor([[7, 3, -1]]), "values": torch.tensor([[2., 1., 0.]]),
        ...          "labels": {7: "the sea"}}
        >>> [t.get_text() for t in top_features(entry).axes[0].get_yticklabels()]
        ['7: the sea', '3']
    """
    if not len(entry["positions"]):
        raise ValueError("the entry holds no position (its selector selected none)")
    indices = _values(entry["indices"][position])
    values = _values(entry["values"][position])
    labels = entry.get("labels") or {}
    kept = [(i, v) for i, v in zip(indices, values) if i >= 0][:k]
    fig = _figure(6.0, max(1.5, 0.35 * len(kept) + 0.8))
    ax = fig.add_subplot()
    names = [f"{i}: {labels[i]}" if i in labels else str(i) for i, _ in kept]
    ax.barh(range(len(kept)), [v for _, v in kept], color="tab:orange")
    ax.set_yticks(range(len(kept)), names, parse_math=False)
    ax.invert_yaxis()
    ax.set_xlabel("activation")
    where = _values(entry["positions"])[position]
    ax.set_title(f"{entry.get('sae', 'SAE')}: top features at position {where}")
    return fig


def logit_attribution(result: Mapping[str, Any], position: int = -1, *,
                      decode: Callable[[int], str] | None = None) -> Any:
    """One position's direct logit attribution: the embedding's, and each layer's attention
    and MLP outputs', as bars per layer.

    Args:
        result: ``out.logit_attribution`` (``output_logit_attribution``).
        position: the row (an index into ``result["positions"]``; default the last).
        decode: token id -> string, for the title.

    Returns:
        A ``matplotlib.figure.Figure``.

    Examples:
        >>> import torch
        >>> from vllm_lens.plot import logit_attribution
        >>> result = {"layers": [0, 1], "positions": torch.tensor([3]),
        ...           "tokens": torch.tensor([42]), "embed": torch.tensor([0.5]),
        ...           "attn_out": torch.tensor([[1.0], [-0.5]]),
        ...           "mlp_out": torch.tensor([[0.25], [2.0]])}
        >>> logit_attribution(result).axes[0].get_title()
        'direct effect on the logit of 42 at position 3 (total 3.25)'
    """
    layers = list(result["layers"])
    attn = [row[position] for row in _values(result["attn_out"])]
    mlp = [row[position] for row in _values(result["mlp_out"])]
    embed = _values(result["embed"])[position]
    token = int(_values(result["tokens"])[position])
    where = _values(result["positions"])[position]
    fig = _figure(max(5.0, 0.35 * len(layers) + 2.0), 3.5)
    ax = fig.add_subplot()
    xs = list(range(len(layers)))
    ax.bar([-1.0], [embed], width=0.8, color="tab:gray", label="embed")
    ax.bar([x - 0.2 for x in xs], attn, width=0.4, color="tab:blue", label="attn_out")
    ax.bar([x + 0.2 for x in xs], mlp, width=0.4, color="tab:red", label="mlp_out")
    ax.set_xticks([-1, *xs], ["emb", *[str(layer) for layer in layers]], fontsize=8)
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("direct logit attribution")
    ax.legend(fontsize=8)
    name = decode(token) if decode is not None and token >= 0 else str(token)
    ax.set_title(f"direct effect on the logit of {name} at position {where} "
                 f"(total {embed + sum(attn) + sum(mlp):.3g})")
    return fig


def side_by_side(plain: str, steered: str, *, titles: Sequence[str] = ("plain", "steered"),
                 width: int = 48) -> Any:
    """Two generations in two columns (wrapped at ``width`` characters).

    Args:
        plain: the first text (``out.outputs[0].text``).
        steered: the second.
        titles: the columns' titles.
        width: characters per line.

    Returns:
        A ``matplotlib.figure.Figure``.

    Examples:
        >>> from vllm_lens.plot import side_by_side
        >>> fig = side_by_side("It is a nice day.", "What a joyful day!")
        >>> [ax.get_title() for ax in fig.axes]
        ['plain', 'steered']
    """
    wrapped = [textwrap.fill(t, width) for t in (plain, steered)]
    lines = max(w.count("\n") + 1 for w in wrapped)
    fig = _figure(2 * width * 0.085 + 0.5, 0.25 * lines + 0.8)
    for i, (text, title) in enumerate(zip(wrapped, titles)):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.axis("off")
        ax.set_title(title)
        ax.text(0.0, 1.0, text, va="top", ha="left", family="monospace", fontsize=9,
                transform=ax.transAxes, parse_math=False)
    return fig
