"""Watch a distributed training run as it goes: per-rank loss curves and a progress bar.

    from ddp_helpers import live
    record = live.train(world_size=2, backend="gloo", width=16, epochs=2)   # settings: train.Config
    record = live.train(world_size=1, backend="nccl", speed=True, **speed.recipes.FAST)  # the speed layer
    live.plot(record)                                                       # the same picture, afterwards

How it works: with `live=True`, rank 0 of `train.run` prints one line of JSON per
logged window of steps, marked with `train.METRICS_PREFIX`. `launch` already forwards
every rank's output to this process as it arrives, through `sys.stdout`; while it runs,
`train` here puts a filter in front of `sys.stdout` that takes the marked lines out,
updates the picture, and lets every other line through. Everything happens in the
cell's own thread, so the Interrupt button, errors and timeouts work as with `launch`.

In a notebook the picture is one PNG, replaced in place (IPython's `display_id`), so the
saved notebook keeps the final state, and nbval sees a fixed text/plain for it. Outside
a notebook, a line of text every 10% of the steps and after each evaluation.
"""
import contextlib
import io
import json
import sys
import time

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from . import data
from . import train as train_module
from .launcher import launch

REDRAW_EVERY_S = 0.5  # at most this often (drawing a figure takes ~0.1 s of the kernel's CPU)


def train(world_size=2, backend="gloo", timeout=900, env=None, view="auto", speed=False, **settings):
    """Run `train.run(**settings)` (with speed=True: `speed.run`, the speed layer) on `world_size` ranks
    and show its progress; return the record (every rank returns the same one).
    view: "auto", "plot" (notebook picture) or "text".
    The ranks' own progress lines are off (verbose=False): the picture replaces them."""
    settings.update(live=True, verbose=False)
    if speed:
        from . import speed as speed_layer
        speed_layer.check(**settings)  # bad settings fail here, before any process starts
        run = speed_layer.run
    else:
        train_module.make_config(**settings)
        run = train_module.run
    data.download_if_missing(settings.get("data"))   # here: the ranks' own network has no way out
    view = PlotView() if view == "plot" or (view == "auto" and in_notebook()) else TextView()
    metrics = MetricsFilter(sys.stdout, view.update)
    try:
        with contextlib.redirect_stdout(metrics):
            results = launch(run, world_size=world_size, backend=backend,
                             kwargs=settings, timeout=timeout, env=env)
    finally:
        metrics.flush()
        view.close()
    return results[0]


def in_notebook():
    """True inside a Jupyter kernel (where pictures can be shown)."""
    ipython = sys.modules.get("IPython")  # never imported: certainly not a notebook
    return hasattr(ipython.get_ipython() if ipython else None, "kernel")


class MetricsFilter(io.TextIOBase):
    """A stand-in for sys.stdout: marked metric lines go to `on_message`, the rest to `out`."""

    def __init__(self, out, on_message):
        self.out, self.on_message, self.partial = out, on_message, ""

    def write(self, text):
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            at = line.find(train_module.METRICS_PREFIX)
            if at >= 0:
                self.on_message(json.loads(line[at + len(train_module.METRICS_PREFIX):]))
            else:
                self.out.write(line + "\n")
        return len(text)

    def flush(self):
        if self.partial:
            self.out.write(self.partial)
            self.partial = ""
        self.out.flush()


class Progress:
    """What the messages of a run told so far, in the shape of a finished record."""

    def __init__(self):
        self.record = {"steps": [], "epochs": [], "total_steps": None, "world_size": None}
        self.started = time.perf_counter()

    def add(self, message):
        kind = message["kind"]
        if kind == "start":
            self.record.update(total_steps=message["total_steps"], world_size=message["world_size"],
                               config={"model": message["model"], "epochs": message["epochs"]},
                               device=message["device"])
        elif kind == "steps":
            self.record["steps"] += message["steps"]
        elif kind == "epoch":
            self.record["epochs"].append(message)
        elif kind == "end":
            self.record.update(test_accuracy=message["test_accuracy"], test_loss=message["test_loss"])
        return kind


class TextView:
    """Progress as plain lines: every 10% of the steps, and after each evaluation."""

    def __init__(self):
        self.progress, self.next_tenth = Progress(), 1

    def update(self, message):
        kind = self.progress.add(message)
        r = self.progress.record
        if kind == "steps" and r["total_steps"]:
            last = r["steps"][-1]
            while last["step"] >= self.next_tenth * r["total_steps"] / 10:
                self.next_tenth += 1
                losses = ", ".join(f"{x:.3f}" for x in last["loss"])
                print(f"step {last['step']}/{r['total_steps']} ({last['step'] / r['total_steps']:.0%})  "
                      f"loss per rank: {losses}  {last['images_per_s']:,.0f} images/s", flush=True)
        elif kind == "epoch":
            print(f"epoch {message['epoch'] + 1}: test accuracy {message['test_accuracy']:.2%}, "
                  f"test loss {message['test_loss']:.3f}", flush=True)

    def close(self):
        pass


class PlotView:
    """One picture in the notebook, redrawn in place as messages arrive."""

    def __init__(self):
        from IPython.display import display
        self.progress, self.last_draw = Progress(), 0.0
        self.handle = display(self._image(), display_id=True)

    def update(self, message):
        kind = self.progress.add(message)
        if kind in ("epoch", "end") or time.perf_counter() - self.last_draw > REDRAW_EVERY_S:
            self.handle.update(self._image())
            self.last_draw = time.perf_counter()

    def close(self):
        self.handle.update(self._image(running=False))

    def _image(self, running=True):
        from IPython.display import Image
        return Image(data=png(draw(self.progress.record, running)))


def plot(record):
    """A matplotlib Figure of a finished run's record (from `train`, `launch(train.run)`, or a
    stored reference file): loss per rank by step, test accuracy by epoch."""
    return draw(record, running=False)


def draw(record, running):
    fig = Picture(figsize=(9, 3.8), dpi=80, layout="constrained")
    axes = fig.subplot_mosaic([["bar", "bar"], ["loss", "acc"]], height_ratios=[1, 8])
    bar, losses, accuracy = axes["bar"], axes["loss"], axes["acc"]
    steps, total = record["steps"], record.get("total_steps") or 1
    done = steps[-1]["step"] if steps else 0
    bar.barh([0], [done / total], color="tab:blue")
    bar.set(xlim=(0, 1), yticks=[], xticks=[], facecolor="0.9")
    bar.set_title(status_line(record, done, total, running), fontsize=10)

    n_ranks = len(steps[0]["loss"]) if steps else 0
    for rank in range(n_ranks):
        losses.plot([s["step"] for s in steps], [s["loss"][rank] for s in steps], lw=1, label=f"rank {rank}")
    losses.set(xlabel="step", ylabel="training loss", xlim=(0, total), title="loss on each rank's own batches")
    if n_ranks:
        losses.legend(loc="upper right", fontsize=8)

    evaluated = [e for e in record["epochs"] if "test_accuracy" in e]
    accuracy.plot([e["epoch"] + 1 for e in evaluated], [100 * e["test_accuracy"] for e in evaluated], "o-")
    epochs = record.get("config", {}).get("epochs") or max([e["epoch"] + 1 for e in evaluated], default=1)
    accuracy.set(xlabel="epoch", ylabel="test accuracy (%)", xlim=(0.5, epochs + 0.5), ylim=(0, 100),
                 title="test accuracy (all ranks together)")
    accuracy.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def status_line(record, done, total, running):
    text = f"step {done}/{total}"
    if record["steps"]:
        text += f"  ·  {record['steps'][-1]['images_per_s']:,.0f} images/s"
    if record.get("world_size"):
        text += f"  ·  {record['world_size']} ranks"
    if "test_accuracy" in record:
        text += f"  ·  final test accuracy {record['test_accuracy']:.1%}"
    else:
        text += "  ·  running" if running else "  ·  stopped before the end"
    return text


class Picture(Figure):
    """A matplotlib Figure that a notebook shows as an image whatever the backend (no pyplot
    here: nothing global, nothing shown twice)."""

    def _repr_png_(self):
        return png(self)


def png(fig):
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()
