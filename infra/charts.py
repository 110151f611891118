"""Charts as inline images: the one way forgeflow turns a matplotlib figure into a picture
that renders wherever its markdown is shown (a Prefect UI artifact, a README, a notebook).

The Prefect UI renders markdown artifacts in the browser, which never loads a `file://`
image from the flow's machine; an image embedded as a base64 `data:image/png` URI travels
inside the artifact and always renders (checked in a real browser: tests/ui_check.py).
A PNG of a few tens of KB is fine in an artifact; keep figures small (dpi ~90).

    fig, ax = new_figure((7, 3.5))
    ...
    markdown_image("loss curve", figure_png(fig))   # -> "![loss curve](data:image/png;base64,...)"

The chart builders live beside the data they draw: the loss curve in training.loss_chart,
the placement picture in scheduler.placement_chart, evaluation trends in evalsuite.reporting.
"""

from __future__ import annotations

import base64
import io
from typing import Any

PNG_DATA_URI_PREFIX = "data:image/png;base64,"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display: flows run on headless machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_figure(size: tuple[float, float], rows: int = 1, cols: int = 1, **kwargs: Any):
    """(figure, axes) from pyplot.subplots on the headless backend."""
    return pyplot().subplots(rows, cols, figsize=size, **kwargs)


def figure_png(fig: Any, dpi: int = 90) -> bytes:
    """The figure as PNG bytes; the figure is closed (pyplot keeps every open figure alive)."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    """`data:image/png;base64,...` for PNG bytes."""
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError("png_data_uri: the bytes are not a PNG (no PNG signature)")
    return PNG_DATA_URI_PREFIX + base64.b64encode(png).decode("ascii")


def markdown_image(alt: str, png: bytes) -> str:
    """A markdown image whose picture is inline: `![alt](data:image/png;base64,...)`."""
    return f"![{alt.replace(']', ')')}]({png_data_uri(png)})"


def inline_pngs(markdown: str) -> list[bytes]:
    """The PNGs embedded as data URIs in markdown, decoded (for tests and checks)."""
    import re

    return [base64.b64decode(m) for m in re.findall(r"\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)]
