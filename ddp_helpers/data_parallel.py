"""Plumbing for notebook 05: read what the profiler recorded around a DDP step.

The lesson (wrapping the model in DDP, running and profiling backward) stays in the
notebook; these functions only read the profiler's events. Call them inside the rank
that profiled.
"""

BACKWARD_PREFIX = "autograd::engine::evaluate_function"  # one event per autograd node the engine runs
GRADIENT_WRITTEN = "torch::autograd::AccumulateGrad"     # a parameter's .grad is written
DDP_LAUNCH = "c10d::allreduce_"                          # DDP hands a bucket to the process group
GLOO_ALL_REDUCE = "gloo:all_reduce"                      # Gloo's thread runs that all-reduce


def profiler_events(prof):
    """(name, start_ms, end_ms, input_shapes) of every CPU event of a finished `torch.profiler.profile`.
    Reads the raw results: building `prof.events()` takes seconds for a few thousand events."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None and hasattr(raw, "events"):
        return [(e.name(), e.start_ns() / 1e6, e.end_ns() / 1e6, e.shapes()) for e in raw.events()]
    return [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3, e.input_shapes) for e in prof.events()]


def checked_events(prof):
    """`profiler_events(prof)`, after checking that each all-reduce started (`c10d::allreduce_`, on
    the caller's thread) has Gloo's record (`gloo:all_reduce`). Gloo's thread closes that record just
    after the all-reduce completes, so backward can return and the profile end first; the record is
    then missing (11 of 30 profiles on 2 busy cores, torch 2.11; none with a 0.05 s pause)."""
    events = profiler_events(prof)
    started = sum(name == DDP_LAUNCH for name, *_ in events)
    recorded = sum(name == GLOO_ALL_REDUCE for name, *_ in events)
    if recorded < started:
        raise RuntimeError(
            f"the profile holds {started} all-reduce launch(es) but Gloo's record of only {recorded}: "
            "Gloo's thread closes a record just after its all-reduce completes, and the profile ended "
            "first. Keep profiling a moment after backward returns: "
            "time.sleep(0.2) inside the `with profile(...)` block")
    return events


def backward_timeline(prof):
    """From a profile around one DDP `loss.backward()`: a dict of times in ms since the first
    autograd node started.

    backward_ms:    when the last autograd node ended (the window in which gradients are computed)
    gradients_ms:   when each parameter's gradient was written (end of each AccumulateGrad), in order
    launches_ms:    when DDP started each bucket's all-reduce (on the backward thread)
    all_reduces_ms: (start, end) of each all-reduce as Gloo's own thread ran it
    """
    events = checked_events(prof)
    backward = [(s, e) for name, s, e, _ in events if name.startswith(BACKWARD_PREFIX)]
    if not backward:
        raise ValueError("no autograd events in this profile: profile a loss.backward() call")
    start = min(s for s, _ in backward)
    return {
        "backward_ms": max(e for _, e in backward) - start,
        "gradients_ms": sorted(e - start for name, _, e, _ in events if name == GRADIENT_WRITTEN),
        "launches_ms": sorted(s - start for name, s, _, _ in events if name == DDP_LAUNCH),
        "all_reduces_ms": sorted((s - start, e - start) for name, s, e, _ in events if name == GLOO_ALL_REDUCE),
    }


def all_reduce_sizes(prof):
    """The number of elements of each Gloo all-reduce in a profile made with `record_shapes=True`,
    in the order they started."""
    runs = sorted((s, shapes) for name, s, _, shapes in checked_events(prof) if name == GLOO_ALL_REDUCE)
    return [shapes[0][0] if shapes and shapes[0] else None for _, shapes in runs]


def all_reduce_dtypes(prof):
    """The element type of each Gloo all-reduce, as the profiler names it ('float' for float32, 'int'
    for int32), in the order they started; from a profile made with `record_shapes=True`. None
    where this torch's profiler keeps no types."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None or not hasattr(raw, "events"):
        return [None for _ in all_reduce_sizes(prof)]
    runs = sorted((e.start_ns(), e.dtypes()) for e in raw.events() if e.name() == GLOO_ALL_REDUCE)
    return [types[0] if types else None for _, types in runs]
