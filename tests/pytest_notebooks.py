"""A pytest plugin for the notebooks (nbval runs each code cell as a test), loaded by pyproject.toml's
`-p pytest_notebooks` (its `pythonpath` puts tests/ on sys.path first). A plugin rather than a conftest.py:
tests/conftest.py is the tests' own, and two modules named conftest (one at the root or in notebooks/)
collide in the worker processes that import the tests. It lives with the tests, not in the package:
a learner's install needs no pytest.

A notebook cell tagged `needs-cifar10` is skipped, with the reason, on a machine that has no copy of
CIFAR-10 and cannot download one (no network, and DDP_HELPERS_CIFAR10 not set): the unit tests that
need the data are skipped there too. Tag every cell that needs the data, or a variable one of them set.
"""
import os

import pytest

DATA_TAG = "needs-cifar10"


def pytest_collection_modifyitems(config, items):
    tagged = [item for item in items
              if DATA_TAG in getattr(getattr(item, "cell", None), "metadata", {}).get("tags", [])]
    if not tagged:
        return
    from ddp_helpers import data
    reason = data.unavailable_reason()
    if reason:
        if not os.environ.get(data.ENV_VAR):
            reason = (f"no CIFAR-10 here: {data.ENV_VAR} is not set and torchvision's copy cannot be "
                      f"downloaded (no network); .ci/run extracts the offline subset and sets it")
        skip = pytest.mark.skip(reason=reason.splitlines()[0])
        for item in tagged:
            item.add_marker(skip)
