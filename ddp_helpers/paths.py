"""The course's own files, found from whichever folder a notebook runs in.

A notebook's kernel runs in the notebook's folder: `notebooks/` for the English edition,
`notebooks/zh/` for the Chinese one. `example("ddp_minimal.py")` names `examples/ddp_minimal.py`
relative to that folder (`../examples/ddp_minimal.py` from `notebooks/`), so that a cell's command and
its printed output read as a learner would type them, and the same cell works from either folder.
"""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def example(name: str) -> str:
    """The path of `examples/<name>`, relative to the current folder (absolute where no relative path exists)."""
    path = os.path.join(EXAMPLES, name)
    try:
        return os.path.relpath(path)
    except ValueError:          # another drive (Windows): no relative path
        return path
