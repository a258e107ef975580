"""Results measured on real GPUs and stored in the repo (notebooks/reference/),
shown by the notebooks on machines without GPUs.

Each result is a CSV file with a JSON file of the same name beside it that says
where it came from: hardware, interconnect, versions, date, command.
"""
import csv
import json
import os

REFERENCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "reference")


def load(name, folder=REFERENCE_DIR):
    """Rows of `<name>.csv` (numbers converted) and the metadata of `<name>.json`."""
    with open(os.path.join(folder, f"{name}.csv"), newline="") as f:
        rows = [{k: parse_value(v) for k, v in row.items()} for row in csv.DictReader(f)]
    with open(os.path.join(folder, f"{name}.json")) as f:
        meta = json.load(f)
    return rows, meta


def load_json(name, folder=None):
    """The report `<name>.json` that a benchmark wrote on its own (no CSV beside it), as a dict:
    e.g. load_json("ddp_overhead_gpu"). Raises FileNotFoundError if it was not measured yet."""
    with open(os.path.join(folder or REFERENCE_DIR, f"{name}.json")) as f:
        return json.load(f)


def save(name, rows, meta, folder=REFERENCE_DIR):
    """Write rows (a list of dicts with the same keys) and their metadata."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")


def label(meta):
    """One line naming where a stored result was measured, for plot legends and captions."""
    parts = [meta.get("hardware", "?")]
    for key in ("interconnect", "torch", "nccl"):
        if meta.get(key):
            parts.append(f"{key} {meta[key]}" if key != "interconnect" else meta[key])
    return f"{', '.join(parts)} (stored, measured {meta.get('date', '?')})"


def parse_value(text):
    """A CSV cell back to a Python value: int, float, True/False, or the text itself."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
