"""The matplotlib backend of a rank (`MPLBACKEND=module://ddp_helpers.runtime.rank_backend`, set by
`rank_io.setup`): Agg draws, and `plt.show()` sends each open figure to the notebook cell as a PNG,
labelled with the rank, then closes it, as Jupyter's inline backend does in a kernel.

It follows matplotlib's interface for third-party backends: FigureCanvas, FigureManager, show.
"""
from typing import Any

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from .rank_io import show_figures

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, **kwargs: Any) -> None:
    """plt.show(): show the open figures in the notebook cell, then close them."""
    show_figures()
