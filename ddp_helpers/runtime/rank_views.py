"""`%%ddp --tabs`: each rank's output on a page of its own (an ipywidgets Tab), instead of the
`[rank N] ...` lines of all ranks in one stream.

`TabSink(ranks)` is an output sink for `output.OutputPump` (see `output.output_sink`):
it shows the Tab at once and adds each rank's lines, errors (stderr) and displays to its page as
they arrive. What the cell returns is still shown below it as `[rank N] value` lines.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_PREFIX = re.compile(r"(^|[\r\n])\[rank \d+\] ")


class TabSink:
    """A Tab with one page (an Output widget) per rank, titled `rank N`."""

    def __init__(self, ranks: Iterable[int]) -> None:
        import ipywidgets
        from IPython.display import display
        self.pages = {r: ipywidgets.Output() for r in ranks}
        self.tab = ipywidgets.Tab(children=list(self.pages.values()))
        for i, r in enumerate(self.pages):
            self.tab.set_title(i, f"rank {r}")
        display(self.tab)

    def write(self, dest: str, pieces: Iterable[tuple[int, str]]) -> None:
        for rank, text in pieces:
            page = self.pages.get(rank)
            if page is None:
                continue
            text = _PREFIX.sub(r"\1", text)
            if dest == "stdout":
                page.append_stdout(text)
            else:
                page.append_stderr(text)

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        page = self.pages.get(rank)
        if page is not None:
            page.outputs += ({"output_type": "display_data", "data": data, "metadata": metadata},)
