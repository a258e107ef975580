"""Results measured on real GPUs and stored in the repo (notebooks/reference/),
shown by the notebooks on machines without GPUs. The one reader of stored results:

    rows, meta = reference.load("bench_all_reduce")   # a table: <name>.csv, and <name>.json beside it
    report = reference.load("ddp_overhead_gpu")       # a report a benchmark wrote alone: <name>.json
    text = reference.load("bench_nccl_debug.txt")     # a log, as text

Each table's JSON says where it came from: hardware, interconnect, versions, date, command.
"""
import csv
import json
import os

REFERENCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "reference")


def load(name, folder=REFERENCE_DIR):
    """A stored result by name:
    - `<name>.csv` exists: (rows, meta), the rows with numbers converted and the metadata of `<name>.json`;
    - else `<name>.json`: the report as a dict;
    - a name with its extension (e.g. "bench_nccl_debug.txt"): that file's text.
    Raises FileNotFoundError, naming what was looked for, when it was not measured yet."""
    path = os.path.join(folder, name)
    if os.path.splitext(name)[1] in (".txt", ".log", ".md"):
        with open(path) as f:
            return f.read()
    if os.path.exists(path + ".csv"):
        with open(path + ".json") as f:
            return read_rows(path + ".csv"), json.load(f)
    if os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            return json.load(f)
    raise FileNotFoundError(f"no stored result {name!r}: neither {name}.csv nor {name}.json in {folder}")


def load_json(name, folder=None):
    """The same as load(name) for a report stored as JSON alone (kept for older callers)."""
    return load(name, folder or REFERENCE_DIR)


def save(name, rows, meta, folder=REFERENCE_DIR):
    """Write rows (a list of dicts with the same keys) and their metadata."""
    write_rows(rows, os.path.join(folder, f"{name}.csv"))
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")


def write_rows(rows, path):
    """Write rows (dicts with the same keys) to a CSV file; creates the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_rows(path):
    """Rows of a CSV file from `write_rows`, with numbers and True/False turned back into Python values."""
    with open(path, newline="") as f:
        return [{k: parse_value(v) for k, v in row.items()} for row in csv.DictReader(f)]


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
