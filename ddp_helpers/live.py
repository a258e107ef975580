"""Watch a distributed training run as it goes: per-rank loss curves and a progress bar.

    from ddp_helpers import live
    record = live.train(world_size=2, backend="gloo", width=16, epochs=2)   # settings: train.Config
    record = live.train(world_size=1, backend="nccl", speed=True, **speed.recipes.FAST)  # the speed layer
    live.plot(record)                                                       # the same picture, afterwards
    records = live.compare({"1 rank": dict(world_size=1, batch_size=64),      # runs one after another,
                            "2 ranks": dict(world_size=2, batch_size=32)},    # their mean loss curves
                           width=16, epochs=2, per_class=100)                 # in one picture

How it works: with `live=True`, rank 0 of `train.run` prints one line of JSON per
logged window of steps, marked with `progress.METRICS_PREFIX`. `launch` already forwards
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
from .progress import METRICS_PREFIX

REDRAW_EVERY_S = 0.5  # at most this often (drawing a figure takes ~0.1 s of the kernel's CPU)


def train(world_size=2, backend="gloo", timeout=900, env=None, view="auto", speed=False, **settings):
    """Run `train.run(**settings)` (with speed=True: `speed.run`, the speed layer) on `world_size` ranks
    and show its progress; return the record (every rank returns the same one).
    view: "auto", "plot" (notebook picture) or "text".
    The ranks' own progress lines are off (verbose=False): the picture replaces them."""
    run = checked(settings, speed)
    view = PlotView() if view == "plot" or (view == "auto" and in_notebook()) else TextView()
    try:
        return launch_live(run, settings, world_size, backend, timeout, env, view.update)
    finally:
        view.close()


def compare(runs, backend="gloo", timeout=900, env=None, view="auto", **common):
    """Train several runs one after another and draw their loss curves in one picture (each curve:
    the mean over its ranks of the loss at each step); return {name: record}.
    runs: {name: settings of that run, world_size included (default 1)}; common: the settings all
    runs share (train.Config). Every run's settings are checked before the first one starts.
    Each rank uses one thread (OMP_NUM_THREADS=1, unless env says otherwise), so that runs of 1 and of
    several ranks compute alike, and a busy machine's cores are not oversubscribed."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    plans = {}
    for name, own in runs.items():
        settings = {**common, **own}
        world_size = settings.pop("world_size", 1)
        plans[name] = (world_size, settings, checked(settings, speed=False, fetch=False))
    for _, settings, _ in plans.values():
        data.download_if_missing(settings.get("data"))   # here: the ranks' own network has no way out
    view = ComparePlot(list(plans)) if view == "plot" or (view == "auto" and in_notebook()) \
        else CompareText(list(plans))
    records = {}
    try:
        for name, (world_size, settings, run) in plans.items():
            view.begin(name)
            records[name] = launch_live(run, settings, world_size, backend, timeout, env, view.update)
            view.finish(records[name])
    finally:
        view.close()
    return records


def checked(settings, speed, fetch=True):
    """The function the ranks run, once `settings` (changed in place: live, not verbose) passed
    its checks, and (fetch) the data is there."""
    settings.update(live=True, verbose=False)
    if speed:
        from . import speed as speed_layer
        speed_layer.check(**settings)  # bad settings fail here, before any process starts
        run = speed_layer.run
    else:
        train_module.make_config(**settings)
        run = train_module.run
    if fetch:
        data.download_if_missing(settings.get("data"))   # here: the ranks' own network has no way out
    return run


def launch_live(run, settings, world_size, backend, timeout, env, on_message):
    """`launch(run)`, with every metric message that rank 0 prints sent to `on_message`."""
    metrics = MetricsFilter(sys.stdout, on_message)
    try:
        with contextlib.redirect_stdout(metrics):
            results = launch(run, world_size=world_size, backend=backend,
                             kwargs=settings, timeout=timeout, env=env)
    finally:
        metrics.flush()
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
            at = line.find(METRICS_PREFIX)
            if at >= 0:
                self.on_message(json.loads(line[at + len(METRICS_PREFIX):]))
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


def mean_loss(record):
    """(steps, the mean over ranks of each step's loss) of a record."""
    return ([s["step"] for s in record["steps"]],
            [sum(s["loss"]) / len(s["loss"]) for s in record["steps"]])


class CompareText:
    """The runs of `compare` as plain lines: one when each run ends."""

    def __init__(self, names):
        self.names = names

    def begin(self, name):
        self.name = name

    def update(self, message):
        pass

    def finish(self, record):
        steps, loss = mean_loss(record)
        print(f"{self.name}: {len(steps)} steps, mean loss {loss[0]:.3f} -> {loss[-1]:.3f}, "
              f"test accuracy {record['test_accuracy']:.1%}", flush=True)

    def close(self):
        pass


class ComparePlot:
    """The runs of `compare` in one picture, redrawn in place: each run's mean loss by step."""

    def __init__(self, names):
        from IPython.display import display
        self.names, self.done, self.last_draw = names, {}, 0.0
        self.name, self.progress = None, Progress()
        self.handle = display(self._image(), display_id=True)

    def begin(self, name):
        self.name, self.progress = name, Progress()

    def update(self, message):
        kind = self.progress.add(message)
        if kind in ("epoch", "end") or time.perf_counter() - self.last_draw > REDRAW_EVERY_S:
            self.handle.update(self._image())
            self.last_draw = time.perf_counter()

    def finish(self, record):
        self.done[self.name] = record
        self.name = None

    def close(self):
        self.handle.update(self._image())

    def _image(self):
        from IPython.display import Image
        return Image(data=png(draw_compare(self.names, self.done, self.name, self.progress.record)))


def draw_compare(names, done, running_name=None, running=None):
    """One axes: the mean loss by step of each finished run (`done`: name -> record) and of the run
    in progress (`running`: its record so far); the title says how far the runs are."""
    fig = Picture(figsize=(9, 3.8), dpi=80, layout="constrained")
    axes = fig.subplot_mosaic([["bar"], ["loss"]], height_ratios=[1, 8])
    bar, ax = axes["bar"], axes["loss"]
    total = max([r.get("total_steps") or 1 for r in done.values()] +
                [(running or {}).get("total_steps") or 1])
    share = 0.0  # of the current run
    if running_name and running and running["steps"] and running["total_steps"]:
        share = running["steps"][-1]["step"] / running["total_steps"]
    bar.barh([0], [(len(done) + share) / len(names)], color="tab:blue")
    bar.set(xlim=(0, 1), yticks=[], xticks=[], facecolor="0.9")
    for i, name in enumerate(names):
        record = done.get(name) or (running if name == running_name else None)
        if record and record["steps"]:
            steps, loss = mean_loss(record)
            ax.plot(steps, loss, lw=1.2, color=f"C{i}", label=name)
    if running_name:
        status = f"run {names.index(running_name) + 1}/{len(names)}: {running_name}"
        if running and running["steps"]:
            status += f", step {running['steps'][-1]['step']}/{running['total_steps']}"
    else:
        status = f"{len(done)}/{len(names)} runs done"
    bar.set_title(status, fontsize=10)
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", xlim=(0, total))
    if ax.lines:
        ax.legend(loc="upper right", fontsize=8)
    return fig


class Picture(Figure):
    """A matplotlib Figure that a notebook shows as an image whatever the backend (no pyplot
    here: nothing global, nothing shown twice)."""

    def _repr_png_(self):
        return png(self)


def png(fig):
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()
