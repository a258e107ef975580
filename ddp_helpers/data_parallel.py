"""Plumbing for notebook 05: turn a profiled DDP backward pass into a timeline.

The lesson (wrapping the model in DDP, running and profiling backward) stays in the
notebook; this only reads the profiler's events. Call it inside the rank that profiled.
"""

BACKWARD_PREFIX = "autograd::engine::evaluate_function"  # one event per autograd node the engine runs
GRADIENT_WRITTEN = "torch::autograd::AccumulateGrad"     # a parameter's .grad is written
DDP_LAUNCH = "c10d::allreduce_"                          # DDP hands a bucket to the process group
GLOO_ALL_REDUCE = "gloo:all_reduce"                      # Gloo's thread runs that all-reduce


def backward_timeline(prof):
    """From a `torch.profiler.profile` around one DDP `loss.backward()`: a dict of times in ms
    since the first autograd node started.

    backward_ms:    when the last autograd node ended (the window in which gradients are computed)
    gradients_ms:   when each parameter's gradient was written (end of each AccumulateGrad), in order
    launches_ms:    when DDP started each bucket's all-reduce (on the backward thread)
    all_reduces_ms: (start, end) of each all-reduce as Gloo's own thread ran it
    """
    events = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()]
    backward = [(s, e) for name, s, e in events if name.startswith(BACKWARD_PREFIX)]
    if not backward:
        raise ValueError("no autograd events in this profile: profile a loss.backward() call")
    start = min(s for s, _ in backward)
    return {
        "backward_ms": max(e for _, e in backward) - start,
        "gradients_ms": sorted(e - start for name, _, e in events if name == GRADIENT_WRITTEN),
        "launches_ms": sorted(s - start for name, s, _ in events if name == DDP_LAUNCH),
        "all_reduces_ms": sorted((s - start, e - start) for name, s, e in events if name == GLOO_ALL_REDUCE),
    }
