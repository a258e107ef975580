"""Notebook 10's checker (a 1F1B schedule by hand) accepts the solution and names each wrong answer,
including answers that give the right gradients by another algorithm (GPipe's order, no pipelining),
and its byte counter counts what the ranks sent."""
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import exercises, launch, solutions


def gpipe(forward, backward, m, rank, p):
    for i in range(m):
        forward(i)
    for i in range(m):
        backward(i)


def test_the_solution_is_accepted():
    verdict = exercises.check_one_f_one_b(solutions.one_f_one_b)
    assert verdict and repr(verdict) == "✅ my_1f1b: correct.", repr(verdict)


def test_the_stub_is_named():
    def stub(forward, backward, m, rank, p):
        raise NotImplementedError("Try it")
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(stub)
    assert not verdict and "still raises NotImplementedError" in repr(verdict)


def test_gpipe_gives_the_right_gradients_and_is_rejected_for_its_memory():
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(gpipe)
    text = repr(verdict)
    assert not verdict and "rank 0 held 4 micro-batches' activations at once" in text, text
    assert "that is GPipe's memory" in text and "at most 2" in text


def test_an_order_that_never_fills_the_pipeline_is_rejected_for_its_bubble():
    def one_at_a_time(forward, backward, m, rank, p):
        for i in range(m):
            forward(i)
            backward(i)
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(one_at_a_time)
    text = repr(verdict)
    assert not verdict and "rank 0 idles 50% of the step" in text and "(p-1)/(m+p-1) = 20%" in text, text


def test_a_missing_backward_is_named():
    def forgets_the_last(forward, backward, m, rank, p):
        solutions.one_f_one_b(forward, lambda i: None if i == m - 1 else backward(i), m, rank, p)
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(forgets_the_last)
    assert not verdict and "rank 0 never ran backward(3)" in repr(verdict), repr(verdict)


def test_backwards_out_of_order_are_named():
    def last_first(forward, backward, m, rank, p):
        for i in range(m):
            forward(i)
        for i in reversed(range(m)):
            backward(i)
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(last_first)
    assert not verdict and "ran its backwards in the order [3, 2, 1, 0]" in repr(verdict), repr(verdict)


def test_an_extra_message_is_named():
    def chatty(forward, backward, m, rank, p):
        solutions.one_f_one_b(forward, backward, m, rank, p)
        if rank == 1:
            dist.send(torch.zeros(1), dst=0)
        if rank == 0:
            dist.recv(torch.zeros(1), src=1)
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(chatty)
    assert not verdict and "rank 1 sent a message of 4 bytes to rank 0" in repr(verdict), repr(verdict)


def test_a_backward_before_its_forward_is_named():
    def backward_first(forward, backward, m, rank, p):
        backward(0)
    with decisive((2, 4)):
        verdict = exercises.check_one_f_one_b(backward_first)
    assert not verdict and "backward(0) on rank" in repr(verdict) and "before forward(0)" in repr(verdict)


def _ring_of_sends():
    rank, n = dist.get_rank(), dist.get_world_size()
    got = torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.ones(3) * rank, (rank + 1) % n),
           dist.P2POp(dist.irecv, got, (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    work = dist.isend(torch.zeros(5), dst=(rank + 1) % n)
    dist.recv(torch.zeros(5), src=(rank - 1) % n)
    work.wait()
    return int(got[0])


def test_counting_sends_counts_batch_isend_irecv_and_isend():
    results = launch(exercises.counting_sends, 3, args=(_ring_of_sends,), quiet=True)
    assert results == [(2, 12 + 20), (0, 12 + 20), (1, 12 + 20)]


# ---- facts notebook 10 states from the installed torch's source (a release that changes them fails here)

def _cp_attention_module():
    import importlib
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise AssertionError("context parallel's _attention module moved")


def test_1f1b_warms_up_with_p_minus_s_forwards():
    import inspect

    from torch.distributed.pipelining import Schedule1F1B
    source = inspect.getsource(Schedule1F1B._step_microbatches)
    assert "self._num_stages - self._stage.stage_index" in source and "warmup_chunks = min(" in source


def test_context_parallel_rings_only_the_cuda_kernels_and_gathers_by_default():
    import inspect
    attention = _cp_attention_module()
    assert attention._cp_options.rotate_method.name == "ALL_GATHER"
    handler = inspect.getsource(attention._sdpa_handler)
    for kernel in ("flash_attention", "efficient_attention", "cudnn_attention"):
        assert f"_scaled_dot_product_{kernel}.default" in handler
    assert "for_cpu" not in handler
    assert "alltoall" in inspect.getsource(attention.set_rotate_method)
    assert "_templated_ring_attention_backward" in dir(attention)
