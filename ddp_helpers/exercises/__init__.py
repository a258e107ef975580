"""Checkers for the notebooks' "Try it" exercises: `from ddp_helpers import exercises`.

Each checker runs the learner's function on real ranks, for several world sizes (and tensor
lengths, including lengths the world size does not divide), and says exactly what is wrong: which
case, which rank, which element, expected vs got. It checks the algorithm too, not only the result:
inside the ranks, spies note the collectives and messages each rank makes, with their bytes, so a
right result reached the wrong way is named. What comes back from the ranks is plain data (numbers,
strings, tensors, and lists, tuples and dicts of them, converted inside the rank), compared by exact
type: no object of the learner's is unpickled in the kernel. After the public cases, each checker
with data runs one drawn at random when it is called, so looking the public cases up does not pass.
Every checker returns a `Verdict`, true when every case passes. Reference solutions are in
`ddp_helpers/solutions.py` (peek after trying).

The package, one concern a module:

    verdict    the Verdict, and the one comparison (`difference`, `close`, `near`)
    plain      what travels from a rank to the kernel: plain data only (`to_plain`, `from_plain`)
    spies      the one layer of spies: patch-and-restore of dist.*, call logs, p2p recording,
               the dispatch-mode recorder of c10d collectives
    runner     the one case runner (launch, hangs, errors, the stub, plain results, unseen cases;
               the cases of one world size in one launch)
    traffic    who sent what to whom, and the longest chain of messages (rounds)
    collective_log  every c10d collective a rank runs, with its bytes and all-to-all splits
    welcome 00 · collectives 00-03 · timing 04 · data_parallel 05 · ddp_cifar10 06 ·
    performance_lab 07 · sharding 08 · tensor_parallel 09 · pipeline_context 10 ·
    beyond_one_machine 11 · debugging 12 · experts 13: the checkers, by notebook
"""
from .beyond_one_machine import check_torchrun_command
from .collectives import (
                          check_all_gather,
                          check_parity_group_sum,
                          check_rank_squares,
                          check_ring_all_reduce,
                          check_tree_broadcast,
)
from .data_parallel import check_one_bucket_average
from .ddp_cifar10 import check_exact_accuracy, check_steps_per_epoch, sampler_share
from .debugging import check_mean_loss
from .performance_lab import check_fp16_compress_hook
from .pipeline_context import check_one_f_one_b, counting_sends
from .sharding import check_shard_and_reassemble
from .spies import RuleBroken
from .tensor_parallel import ROW_PARALLEL_CASES, check_row_parallel
from .timing import check_all_reduce_timing
from .traffic import Traffic
from .verdict import Verdict
from .welcome import SLOWEST_RANK_CASES, check_slowest_rank

__all__ = [
    "Verdict", "RuleBroken", "Traffic",
    "check_slowest_rank", "SLOWEST_RANK_CASES",                                       # 00
    "check_rank_squares", "check_parity_group_sum", "check_all_gather", "check_tree_broadcast",
    "check_ring_all_reduce",                                                           # 00-03
    "check_all_reduce_timing",                                                         # 04
    "check_one_bucket_average",                                                        # 05
    "check_steps_per_epoch", "check_exact_accuracy", "sampler_share",                  # 06
    "check_fp16_compress_hook",                                                        # 07
    "check_shard_and_reassemble",                                                      # 08
    "check_row_parallel", "ROW_PARALLEL_CASES",                                        # 09
    "check_one_f_one_b", "counting_sends",                                             # 10
    "check_torchrun_command",                                                          # 11
    "check_mean_loss",                                                                 # 12
]
