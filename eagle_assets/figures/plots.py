"""PNG histograms of response lengths for the Dagster UI (matplotlib, headless Agg backend)."""

from __future__ import annotations

import base64
import io
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def figure_png(fig) -> bytes:
    """PNG bytes of a matplotlib figure, which is closed afterwards (figures are not freed otherwise)."""
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def length_histogram_png(
    series: Mapping[str, Sequence[int]],
    title: str,
    short_tokens: int | None = None,
    cap: int | None = None,
    bins: int = 40,
) -> bytes:
    """Overlaid histograms of token lengths (one per label in ``series``) as PNG bytes.

    A dashed line marks the short threshold, a dotted one the ``max_new_tokens`` cap, so a pile-up at either is
    visible at a glance.
    """
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=80)
    for label, values in series.items():
        if len(values):
            ax.hist(list(values), bins=bins, alpha=0.55, label=f"{label} (n={len(values)})")
    if short_tokens is not None:
        ax.axvline(short_tokens, color="red", linestyle="--", linewidth=1, label=f"short < {short_tokens}")
    if cap is not None:
        ax.axvline(cap, color="black", linestyle=":", linewidth=1, label=f"cap {cap}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("rows")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return figure_png(fig)


def png_markdown(png: bytes, alt: str = "histogram") -> str:
    """Markdown that embeds ``png`` inline (data URI), which Dagster's UI renders in metadata."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
