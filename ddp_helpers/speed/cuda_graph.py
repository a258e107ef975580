"""Replay each training step's forward and backward as one CUDA graph (GPU runs only).

    stream = side_stream(device)
    with torch.cuda.stream(stream):
        model = DDP(model)                    # DDP is built on the stream the graph is captured on
    step = CapturedStep(forward_backward, stream)   # forward_backward(images, labels) -> loss
    for images, labels in loader:
        loss = step(images, labels)           # steps 1-11 eager; step 12 recorded; then replayed
        optimizer.step()

Why: in eager mode Python queues every kernel of every step one by one, a few microseconds
each. A small network on a fast GPU finishes its kernels sooner than Python can queue them,
so the GPU waits, and a second GPU cannot help: each process's CPU is the bottleneck, and
DDP adds CPU work of its own (hooks, bucket bookkeeping). A CUDA graph records the kernels of
one step once; replaying it is one call, whatever the number of kernels.

How, following the CUDA Graphs notes of PyTorch ("whole network capture", "usage with
DistributedDataParallel"; https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs):
- One side stream does everything: building DDP (which makes the autograd nodes that
  accumulate gradients, bound to the stream they were made on), the first steps, and the
  capture. The first steps run eagerly: cuDNN picks its algorithms, the allocator grows,
  DDP rebuilds its buckets; DDP needs 11 such iterations before capture. They are real
  training steps, not thrown away.
- The graph reads its inputs from fixed tensors: each step copies the batch into them.
- Gradients are set to None just before capture: the recorded backward then writes fresh
  gradients (into DDP's buckets, or memory of the graph's own), and replays rewrite them.
  Nobody may zero or replace them afterwards.
- Autocast must not cache its casts inside a captured region (cache_enabled=False).
- The notes also ask for NCCL_ASYNC_ERROR_HANDLING=0 before init_process_group; on torch 2.11
  with 2 H200s, DDP capture trained and shut down cleanly without it (tests/test_speed.py).
- The graph holds NCCL operations: free it (`release`) before destroy_process_group, which
  otherwise waits forever (seen on torch 2.11).
The optimizer step stays outside the graph: a handful of foreach kernels, and the learning
rate keeps coming from the scheduler as a Python number.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

EAGER_STEPS = 11   # DDP's requirement before capturing its backward


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for the life of the process. PyTorch gives every (cuBLAS handle,
    stream) pair a workspace of its own and keeps it until the process ends
    (aten/src/ATen/cuda/CublasHandlePool.cpp), so a new stream for every run would leave
    one more workspace behind each time: in a notebook kernel, or a benchmark's repeated runs."""
    return torch.cuda.Stream(device)


class CapturedStep:
    """Runs forward_backward(images, labels) eagerly for the first `eager_steps` calls, then
    records it once as a CUDA graph and replays it on every later call. Returns the loss."""
    capture_error_mode = "global"   # torch.cuda.graph's: what other threads may do during capture

    def __init__(self, forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 side_stream: torch.cuda.Stream, eager_steps: int = EAGER_STEPS) -> None:
        self.forward_backward = forward_backward
        self.side_stream = side_stream
        self.eager_steps = eager_steps
        self.calls = 0
        self.graph = None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.eager_steps:
            return self.eager(images, labels)
        if self.graph is None:
            self.capture(images, labels)  # records the step without running it
        else:
            self.static_images.copy_(images)
            self.static_labels.copy_(labels)
        self.graph.replay()
        return self.static_loss.clone()   # the next replay overwrites static_loss

    def eager(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        current = torch.cuda.current_stream()
        self.side_stream.wait_stream(current)      # the batch was made on the current stream
        with torch.cuda.stream(self.side_stream):
            loss = self.forward_backward(images, labels)
        current.wait_stream(self.side_stream)      # the optimizer step comes after
        return loss

    def release(self) -> None:
        """Free the graph; call it before destroy_process_group (see above)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None

    def capture(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.static_images, self.static_labels = images.clone(), labels.clone()
        self.graph = torch.cuda.CUDAGraph()
        self.side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.graph, stream=self.side_stream, capture_error_mode=self.capture_error_mode):
            self.static_loss = self.forward_backward(self.static_images, self.static_labels)
