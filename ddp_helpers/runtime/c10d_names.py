"""What torch.distributed's c10d operators are called: the one home of their names.

Below torch.distributed's Python functions, every collective reaches a c10d operator, whose schema
name ('c10d::allreduce_', 'c10d::_allgather_base_') is not what a learner typed. Two readings:

- `called_as`: the torch.distributed function that reaches it ('c10d::_allgather_base_' ->
  'all_gather_into_tensor'), for a message about the call the learner wrote (`rank_io`: a collective
  in a `%%ddp --ranks` cell);
- `collective_name`: the collective it belongs to ('c10d::allgather_into_tensor_coalesced_' ->
  'all_gather', 'c10d::_reduce_scatter_base_' -> 'reduce_scatter'), as the checkers' spies note calls
  (`exercises.spies`), whichever of torch's spellings reached it.
"""
from __future__ import annotations

# operator -> the torch.distributed function a learner calls to reach it (others: the same name)
CALLED_AS = {"allreduce": "all_reduce", "allgather": "all_gather", "allgather_into_tensor_coalesced":
             "all_gather_into_tensor", "_allgather_base": "all_gather_into_tensor",
             "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
             "alltoall": "all_to_all", "alltoall_base": "all_to_all_single", "recv": "recv",
             "recv_any_source": "recv (from any source)"}


def operator(schema_name: str) -> str:
    """'c10d::allreduce_' -> 'allreduce' (an in-place operator's trailing _ dropped)."""
    return schema_name.split("::")[-1].rstrip("_")


def called_as(schema_name: str) -> str:
    """'c10d::allreduce_' -> 'all_reduce': the torch.distributed function that reaches the operator."""
    name = operator(schema_name)
    return CALLED_AS.get(name, name)


def collective_name(schema_name: str) -> str:
    """'c10d::allgather_into_tensor_coalesced_' -> 'all_gather', 'c10d::_reduce_scatter_base_' ->
    'reduce_scatter', 'c10d::allreduce_' -> 'all_reduce'."""
    op = operator(schema_name).strip("_").replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    return op.replace("_base", "").replace("_into_tensor_coalesced", "").replace("_coalesced", "")
