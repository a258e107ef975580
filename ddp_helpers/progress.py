"""What a training run keeps and tells: its record, lines of text (verbose) and metric messages (live).

Every rank keeps the same record (the losses of all ranks arrive through an all_gather); rank 0
alone prints. A metric message is one line, METRICS_PREFIX + JSON, which the live view
(ddp_helpers.live) takes out of the output stream and draws; other lines reach the notebook as they are.
"""
import json
import os
import sys

METRICS_PREFIX = "@@ddp_helpers.metrics "


def restart_count():
    """How many times torchrun has restarted the worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Log:
    """The record of one run and rank 0's messages. Its methods take the trainer `t`; it keeps none
    (a trainer that keeps its log, which kept the trainer, would be freed only by the garbage collector)."""

    def __init__(self, t, config, restarts):
        self.speaks, self.live, self.verbose, self.epochs = t.rank == 0, t.cfg.live, t.cfg.verbose, t.cfg.epochs
        self.epoch_start = 0
        self.record = {"config": config, "device": str(t.device), "world_size": t.world_size,
                       "backend": t.backend, "total_steps": t.total_steps, "steps": [], "epochs": [],
                       "train_seconds": 0.0, "restart_count": restarts}

    def tell(self, message, line):
        """message: a dict for the live view (or None); line: text for a person (or None)."""
        if self.speaks and self.live and message:
            say(METRICS_PREFIX + json.dumps(message))
        if self.speaks and self.verbose and line:
            say(line)

    def start(self, t, resumed_from):
        """Training starts (after a checkpoint, if any, was loaded)."""
        self.record.update(resumed_from=resumed_from, start_step=t.step)
        self.tell({"kind": "start", "total_steps": t.total_steps, "start_step": t.step, "epochs": t.cfg.epochs,
                   "world_size": t.world_size, "model": t.cfg.model, "device": t.device.type},
                  f"{t.cfg.model} on {t.world_size} rank(s), {t.device.type}, {t.backend}: "
                  f"{len(t.train_loader)} steps/epoch of {t.cfg.batch_size} images per rank")
        if self.record["restart_count"]:
            self.tell(None, f"restarted by torchrun: TORCHELASTIC_RESTART_COUNT={self.record['restart_count']}")
        if t.step:
            self.tell(None, f"resumed at step {t.step}/{t.total_steps} (epoch {t.start_epoch + 1})")

    def steps(self, t, epoch, table, lrs, images_per_s):
        """table: (ranks, steps + 1) on the CPU: each rank's losses, then its peak GPU memory (GB)."""
        first = t.step - len(lrs) + 1
        steps = [{"step": first + i, "epoch": epoch, "loss": table[:, i].tolist(), "lr": lr,
                  "images_per_s": images_per_s} for i, lr in enumerate(lrs)]
        if t.device.type == "cuda":
            for s in steps:
                s["peak_memory_gb"] = table[:, -1].tolist()
        self.record["steps"] += steps
        last = table[:, -2].tolist()
        self.tell({"kind": "steps", "steps": steps},
                  f"step {t.step}/{t.total_steps}  epoch {epoch + 1}  loss {sum(last) / len(last):.3f} "
                  f"(per rank: {', '.join(f'{x:.3f}' for x in last)})  {images_per_s:,.0f} images/s")

    def epoch(self, t, epoch, seconds, test=None):
        """After an epoch: its mean training loss (over steps and ranks) and, if evaluated, test loss and accuracy."""
        steps = self.record["steps"][self.epoch_start:]
        self.epoch_start = len(self.record["steps"])
        summary = {"epoch": epoch, "seconds": seconds,
                   "train_loss": sum(sum(s["loss"]) for s in steps) / (len(steps) * t.world_size),
                   "images_per_s": len(steps) * t.cfg.batch_size * t.world_size / seconds}
        self.record["train_seconds"] += seconds
        self.record["epochs"].append(summary)
        if test:
            self.tested(*test)

    def tested(self, test_loss, test_accuracy):
        s = self.record["epochs"][-1]
        s.update(test_loss=test_loss, test_accuracy=test_accuracy)
        self.tell({"kind": "epoch", **s}, f"epoch {s['epoch'] + 1}/{self.epochs}  train loss "
                  f"{s['train_loss']:.3f}  test loss {test_loss:.3f}  test accuracy {test_accuracy:.2%}  "
                  f"{s['images_per_s']:,.0f} images/s")

    def end(self, t, test_loss, test_accuracy, eval_seconds, total_seconds):
        r = self.record
        r.update(test_loss=test_loss, test_accuracy=test_accuracy, eval_seconds=eval_seconds,
                 total_seconds=total_seconds)
        if r["epochs"]:
            self.tested(test_loss, test_accuracy)
        if t.device.type == "cuda" and r["steps"]:
            r["peak_memory_gb"] = r["steps"][-1]["peak_memory_gb"]
        self.tell({"kind": "end", "test_accuracy": test_accuracy, "test_loss": test_loss},
                  f"done: test accuracy {test_accuracy:.2%}, test loss {test_loss:.3f}, "
                  f"{r['train_seconds']:.1f} s of training")
        return r


def say(line):
    """One write per line: torchrun runs workers unbuffered (python -u), where print() writes the text and
    the newline apart, and the lines of ranks sharing a log could merge."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
