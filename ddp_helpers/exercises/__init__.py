"""Checkers for the notebooks' "Try it" exercises.

Each checker runs the learner's function on real ranks, for several world
sizes (and tensor lengths, including lengths the world size does not divide),
and says exactly what is wrong: which case, which rank, which element,
expected vs got. Where an exercise rebuilds a collective from point-to-point
calls, that collective is switched off inside the ranks while the learner's
code runs; where an exercise is about how many collective calls to make, the collective is
wrapped instead, to count each rank's calls and bytes. The point-to-point exercises are checked
for their algorithm too: send/recv/isend/irecv are wrapped in each rank to count the messages and
bytes each rank sends and receives and the rounds the whole takes (class Traffic), so a right
result reached the wrong way (gathering everything at rank 0, a chain instead of a tree) is named.
The returned Verdict is true when every case passes.
Reference solutions are in `ddp_helpers/solutions.py` (peek after trying).
"""
import contextlib
import math

import torch
import torch.distributed as dist

from ..launcher import WorkerError, WorkerTimeout, launch


class Verdict:
    """What a checker found. True when correct; shown as a short report in the notebook."""

    def __init__(self, title, problems, notes=()):
        self.title, self.problems, self.notes = title, problems, list(notes)

    def __bool__(self):
        return not self.problems

    def __repr__(self):
        if not self.problems:
            lines = [f"✅ {self.title}: correct."]
        else:
            lines = [f"❌ {self.title}: not yet."] + [f"   - {p}" for p in self.problems[:5]]
        return "\n".join(lines + [f"   {note}" for note in self.notes])

    def _repr_pretty_(self, printer, cycle):
        """In a notebook: lines wrapped at 100 characters, between words (JupyterLab would cut words)."""
        import textwrap
        lines = []
        for line in repr(self).splitlines():
            indent = " " * (len(line) - len(line.lstrip(" -")))
            lines += textwrap.wrap(line, 100, subsequent_indent=indent, break_on_hyphens=False) or [""]
        printer.text("\n".join(lines))


class RuleBroken(RuntimeError):
    """The exercise asked to build this without the collective it called."""


def _forbid(names):
    def refuse(name):
        def call(*args, **kwargs):
            raise RuleBroken(f"this exercise is about building it yourself: use send/recv, not dist.{name}")
        return call
    return {name: refuse(name) for name in names}


def _run_in_rank(fn, make_input, forbidden):
    """Inside a rank: switch off the forbidden collectives, call fn, restore them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    forbidden = [name for name in forbidden if hasattr(dist, name)]  # names vary across torch versions
    saved = {name: getattr(dist, name) for name in forbidden}
    for name, stub in _forbid(forbidden).items():
        setattr(dist, name, stub)
    try:
        return fn(*make_input(rank, world_size))
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


# ---- Counting the point-to-point traffic inside a rank -------------------------------------
# The p2p checkers wrap dist.send/recv/isend/irecv (in torch.distributed and in distributed_c10d,
# where batch_isend_irecv and P2POp look them up) to write down, in program order, every message a
# rank posts and every receive it completes. The kernel then matches sends with receives (first
# send from a to b with first receive at b from a, and so on) and counts per rank the messages,
# the bytes and the rounds.

_P2P = ("send", "recv", "isend", "irecv")


class _Completion:
    """A Work handle that notes when the learner waits for a receive."""

    def __init__(self, work, on_wait):
        self._work, self._on_wait = work, on_wait

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._on_wait()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _peer(args, kwargs, key):
    """The global rank a p2p call names (dst/src positionally or by keyword, or group_dst/group_src)."""
    peer = args[0] if args else kwargs.get(key)
    if peer is None and kwargs.get(f"group_{key}") is not None:
        peer = kwargs[f"group_{key}"]
        group = kwargs.get("group")
        if group is not None and group != dist.group.WORLD:
            peer = dist.get_global_rank(group, peer)
    return peer


def _recording_p2p(events):
    """Replacements for send/recv/isend/irecv that append to `events` and call the real ones."""
    from torch.distributed import distributed_c10d as c10d
    real = {name: getattr(c10d, name) for name in _P2P}
    counts = {}

    def numbered(kind, peer):
        key = (kind, peer)
        counts[key] = counts.get(key, -1) + 1
        return counts[key]

    inside = []   # torch's own send/recv may call isend/irecv: count the outermost call only

    def outermost(record):
        def call(tensor, *args, **kwargs):
            if inside:
                return real[record.__name__](tensor, *args, **kwargs)
            inside.append(record.__name__)
            try:
                return record(tensor, *args, **kwargs)
            finally:
                inside.pop()
        return call

    def send(tensor, *args, **kwargs):
        peer = _peer(args, kwargs, "dst")
        events.append(("send", peer, numbered("send", peer), tensor.numel() * tensor.element_size()))
        return real["send"](tensor, *args, **kwargs)

    def isend(tensor, *args, **kwargs):
        peer = _peer(args, kwargs, "dst")
        events.append(("send", peer, numbered("send", peer), tensor.numel() * tensor.element_size()))
        return real["isend"](tensor, *args, **kwargs)

    def recv(tensor, *args, **kwargs):
        source = real["recv"](tensor, *args, **kwargs)
        peer = _peer(args, kwargs, "src")
        peer = source if peer is None else peer
        events.append(("recv", peer, numbered("recv", peer), tensor.numel() * tensor.element_size()))
        return source

    def irecv(tensor, *args, **kwargs):
        peer = _peer(args, kwargs, "src")
        index = numbered("recv", peer)   # matched in the order the receives are posted
        work = real["irecv"](tensor, *args, **kwargs)
        done = []

        def on_wait():
            if not done:
                done.append(True)
                events.append(("recv", peer, index, tensor.numel() * tensor.element_size()))
        return _Completion(work, on_wait) if work is not None else work

    return real, {call.__name__: outermost(call) for call in (send, recv, isend, irecv)}


def _run_counting_p2p(fn, make_input, forbidden):
    """Inside a rank: like _run_in_rank, with the p2p calls recorded. Returns (result, events)."""
    from torch.distributed import distributed_c10d as c10d
    events = []
    real, wrapped = _recording_p2p(events)
    for name, call in wrapped.items():
        setattr(c10d, name, call)
        setattr(dist, name, call)
    try:
        return _run_in_rank(fn, make_input, forbidden), events
    finally:
        for name, call in real.items():
            setattr(c10d, name, call)
            setattr(dist, name, call)


class Traffic:
    """Who sent what to whom, from every rank's recorded p2p calls (see _recording_p2p).

    sent[r], received[r]: messages and bytes per rank. rounds: the length of the longest chain of
    messages each of which had to wait for the one before it, where a rank sends one message at a
    time (its link is busy) and can only pass on what it has already received. chain: that chain,
    as (sender, receiver) pairs."""

    def __init__(self, events_per_rank):
        self.world_size = n = len(events_per_rank)
        self.sent = [{"messages": 0, "bytes": 0} for _ in range(n)]
        self.received = [{"messages": 0, "bytes": 0} for _ in range(n)]
        self.message_bytes = {}
        for rank, events in enumerate(events_per_rank):
            for kind, peer, index, nbytes in events:
                side = self.sent if kind == "send" else self.received
                side[rank]["messages"] += 1
                side[rank]["bytes"] += nbytes
                if kind == "send":
                    self.message_bytes[(rank, peer, index)] = nbytes
        self.rounds, self.chain = self._longest_chain(events_per_rank)

    @staticmethod
    def _longest_chain(events_per_rank):
        round_of, before = {}, {}   # message (src, dst, index) -> its round, the message it waited for
        for _ in range(sum(len(e) for e in events_per_rank) + 1):   # acyclic: settles within that many passes
            changed = False
            for rank, events in enumerate(events_per_rank):
                ready, cause = 0, None   # the round by which this rank's link and data are ready
                for kind, peer, index, _ in events:
                    if kind == "send":
                        message = (rank, peer, index)
                        if round_of.get(message) != ready + 1:
                            round_of[message], before[message], changed = ready + 1, cause, True
                        ready, cause = ready + 1, message
                    else:
                        message = (peer, rank, index)
                        if round_of.get(message, 0) > ready:
                            ready, cause = round_of[message], message
            if not changed:
                break
        if not round_of:
            return 0, []
        last = max(round_of, key=round_of.get)
        chain = []
        while last is not None:
            chain.append(last[:2])
            last = before.get(last)
        return max(round_of.values()), chain[::-1]

    def describe_chain(self):
        return ", then ".join(f"{a}→{b}" for a, b in self.chain)


def _difference(expected, got):
    """None when equal, else a short description of the first difference."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"expected a list of {len(expected)} tensors, got {type(got).__name__}" + (
                f" of length {len(got)}" if isinstance(got, (list, tuple)) else "")
        for i, (e, g) in enumerate(zip(expected, got)):
            problem = _difference(e, g)
            if problem:
                return f"item {i}: {problem}"
        return None
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        wrong = (got != expected).flatten().nonzero()
        if len(wrong):
            i = int(wrong[0])
            return f"element {i}: expected {expected.flatten()[i].item():g}, got {got.flatten()[i].item():g}"
        return None
    return None if got == expected else f"expected {expected!r}, got {got!r}"


HANG_TIMEOUT_S = 10   # a learner's ranks that have not finished by then are stuck (a send without its recv)


def _check(title, fn, cases, make_input, expected, forbidden=(), hint="", algorithm=None):
    """Run fn for each (world_size, length) case and compare each rank's result.
    With `algorithm`, the ranks' p2p calls are recorded too, and algorithm(Traffic, world_size, length)
    returns what is wrong with the way the result was computed (a list of problems)."""
    problems = []
    for world_size, length in cases:
        label = f"world_size={world_size}" + (f", length={length}" if length is not None else "")
        inputs = (fn, lambda r, n, k=length: make_input(r, n, k), forbidden)
        try:
            got = launch(_run_counting_p2p if algorithm else _run_in_rank, world_size, args=inputs,
                         timeout=HANG_TIMEOUT_S, quiet=True)
        except WorkerTimeout as err:
            problems.append(f"{label}: rank(s) {err.unfinished_ranks} never finished (a send without "
                            f"its recv, or the other way round?) {hint}".rstrip())
            break  # the other cases would hang the same way: no need to wait for each
        except WorkerError as err:
            if err.exc_type == "NotImplementedError":
                return Verdict(title, [f"{fn.__name__} still raises NotImplementedError: fill in the stub"])
            first_line = str(err).splitlines()[0][:300]
            problems.append(f"{label}: {first_line} {hint}".rstrip())
            continue
        if algorithm:
            traffic = Traffic([events for _, events in got])
            got = [value for value, _ in got]
        wrong = False
        for rank, value in enumerate(got):
            problem = _difference(expected(rank, world_size, length), value)
            if problem:
                wrong = True
                problems.append(f"{label}, rank {rank}: {problem}")
        if algorithm and not wrong:
            problems += [f"{label}: {problem}" for problem in algorithm(traffic, world_size, length)]
    return Verdict(title, problems)


def _no_input(rank, world_size, length):
    return ()


def check_rank_squares(fn):
    """Notebook 00: each rank returns its rank squared."""
    return _check("my_square", fn, [(2, None), (4, None)], _no_input, lambda r, n, k: r * r)


def check_parity_group_sum(fn):
    """Notebook 01: each rank returns the sum of the ranks with its own parity,
    computed with an all_reduce inside a `new_group` of even or odd ranks."""
    hint = "Every rank must call dist.new_group for every group, in the same order, even groups it is not in."
    return _check("parity_group_sum", fn, [(2, None), (3, None), (4, None)], _no_input,
                  lambda r, n, k: sum(i for i in range(n) if i % 2 == r % 2), hint=hint)


def _rank_data(rank, world_size, length):
    """Each rank's own tensor in the p2p exercises: easy to tell apart by eye."""
    return (torch.arange(length, dtype=torch.float32) + 100 * rank,)


_LENGTH_CASES = [(2, 1), (2, 5), (3, 4), (3, 7), (4, 3), (4, 10)]


def _all_gather_traffic(traffic, n, length):
    """An all-gather sends each rank's tensor (S bytes) to every other rank once: every rank sends and
    receives (n-1)·S bytes, whatever the route (directly, or around a ring)."""
    size = 4 * length
    want = (n - 1) * size
    sent = [traffic.sent[r]["bytes"] for r in range(n)]
    received = [traffic.received[r]["bytes"] for r in range(n)]
    busiest = max(range(n), key=lambda r: sent[r])
    if sent[busiest] > want and sum(1 for b in sent if b <= size) >= n - 1:
        return [f"rank {busiest} sent {sent[busiest]} bytes in {traffic.sent[busiest]['messages']} messages, "
                f"every other rank at most {size} (its own tensor): that is gather-to-one-rank-and-send-back. "
                f"It gives the right result, but rank {busiest}'s link carries {sent[busiest] // size} tensors "
                f"while the others idle, and everybody waits for it. Let each rank send its own tensor to every "
                f"other rank: (n-1)·S = {want} bytes per rank, the same on every rank"]
    for rank in range(n):
        if sent[rank] != want:
            return [f"rank {rank} sent {sent[rank]} bytes in {traffic.sent[rank]['messages']} messages; an all-gather "
                    f"needs each rank to send its own {size}-byte tensor to the {n - 1} others: {want} bytes"]
        if received[rank] != want:
            return [f"rank {rank} received {received[rank]} bytes; it needs the {n - 1} other tensors: {want} bytes"]
    return []


def check_all_gather(fn):
    """Notebook 02: `fn(t)` returns the list of every rank's tensor, built from send/recv.
    Also checks how: every rank sends and receives (n-1)·S bytes (no gathering at one rank)."""
    return _check("my_all_gather", fn, _LENGTH_CASES, _rank_data,
                  lambda r, n, k: [_rank_data(i, n, k)[0] for i in range(n)],
                  forbidden=("all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
                             "broadcast"), algorithm=_all_gather_traffic)


def _tree_broadcast_traffic(traffic, n, length):
    """A tree broadcast: every rank but 0 receives the tensor exactly once, and the longest chain of
    messages that wait for each other (a rank sends one at a time) is ceil(log2 n) long."""
    size = 4 * length
    for rank in range(1, n):
        got = traffic.received[rank]
        if got["messages"] != 1 or got["bytes"] != size:
            return [f"rank {rank} received {got['messages']} messages ({got['bytes']} bytes); in a broadcast each "
                    f"rank but the root receives the {size}-byte tensor exactly once"]
    if traffic.received[0]["messages"]:
        return [f"rank 0 received {traffic.received[0]['messages']} message(s): the root already has the data"]
    best = (n - 1).bit_length()   # ceil(log2 n)
    if traffic.rounds > best:
        hint = (f"rank 0 sends all {n - 1} messages itself, one after another"
                if all(a == 0 for a, _ in traffic.chain) else
                "each rank that has the data should send it on in every round, so the number of ranks with the "
                "data doubles")
        return [f"{traffic.rounds} rounds: the longest chain of messages that wait for each other is "
                f"{traffic.describe_chain()} (a rank sends one message at a time). A binary tree needs only "
                f"ceil(log2 {n}) = {best}: {hint}"]
    return []


def check_tree_broadcast(fn):
    """Notebook 02: `fn(t)` returns rank 0's tensor on every rank, sent along a binary tree.
    Also checks how: one message per receiving rank, and at most ceil(log2 n) rounds."""
    return _check("tree_broadcast", fn, _LENGTH_CASES + [(4, 1), (5, 2)], _rank_data,
                  lambda r, n, k: _rank_data(0, n, k)[0],
                  forbidden=("broadcast", "broadcast_object_list", "scatter", "all_gather", "all_reduce"),
                  algorithm=_tree_broadcast_traffic)


def _ring_all_reduce_traffic(traffic, n, length):
    """A ring all-reduce: every rank sends 2(n-1) messages, all to the same neighbour, each one chunk
    of the tensor (torch.tensor_split: chunks differ by at most one element), and the messages of a
    step travel at once, so the longest chain of messages that wait for each other is 2(n-1)."""
    size, steps = 4 * length, 2 * (n - 1)
    chunk_bytes = {4 * (length // n), 4 * -(-length // n)}
    by_rank = [[(peer, nbytes) for (src, peer, _), nbytes in sorted(traffic.message_bytes.items()) if src == rank]
               for rank in range(n)]
    sources = [sorted({src for (src, peer, _) in traffic.message_bytes if peer == rank}) for rank in range(n)]
    hub = max(range(n), key=lambda r: len(sources[r]))
    whole = [(r, peer) for r in range(n) for peer, nbytes in by_rank[r] if nbytes >= size and max(chunk_bytes) < size]
    if len(sources[hub]) > 1 or whole:
        who = (f"rank {hub} received from ranks {', '.join(map(str, sources[hub]))}" if len(sources[hub]) > 1 else
               f"rank {whole[0][0]} sent the whole tensor ({size} bytes) to rank {whole[0][1]}")
        return [f"{who}: that is gathering the tensors at one rank and sending the sum back (or passing whole "
                f"tensors around). The result is right, but one link carries (n-1)·S bytes each way while the "
                f"others idle, and the time grows with n. In a ring, each rank sends only to its neighbour, and "
                f"only one chunk of S/n bytes per step: 2(n-1)/n·S bytes in all, on every link at once"]
    for rank in range(n):
        sent = by_rank[rank]
        if len(sent) != steps:
            return [f"rank {rank} sent {len(sent)} messages; a ring all-reduce sends 2(n-1) = {steps}: n-1 steps of "
                    f"reduce-scatter, then n-1 steps of all-gather, one chunk per step"]
        odd = [nbytes for _, nbytes in sent if nbytes not in chunk_bytes]
        if odd:
            return [f"rank {rank} sent a message of {odd[0]} bytes; each step sends one chunk, "
                    f"{' or '.join(map(str, sorted(chunk_bytes)))} bytes for {length} floats over {n} ranks "
                    f"(torch.tensor_split makes chunks that differ by at most one element)"]
    directions = {(peer - rank) % n for rank in range(n) for peer, _ in by_rank[rank]}
    if len(directions) != 1 or not directions <= {1, n - 1}:
        return ["the ranks do not all send to the same neighbour: in a ring, rank r sends to rank r+1 "
                "(or every rank to r-1) and receives from the other side"]
    if traffic.rounds > steps:
        return [f"{traffic.rounds} rounds instead of 2(n-1) = {steps}: a rank waits to receive before it sends in "
                f"the same step (longest chain: {traffic.describe_chain()}), so the ranks take turns. Post each "
                f"step's send and receive together (dist.batch_isend_irecv), so that every link is busy at once"]
    return []


def check_ring_all_reduce(fn):
    """Notebook 03: `fn(t)` returns the element-wise sum over ranks, by reduce-scatter then
    all-gather around a ring, with lengths the world size does not divide. Also checks how: per rank,
    2(n-1) messages of one chunk each to one neighbour, in 2(n-1) rounds (not gather-and-send-back).
    Reference solution: ddp_helpers/solutions.py, ring_all_reduce."""
    return _check("ring_all_reduce", fn, _LENGTH_CASES, _rank_data,
                  lambda r, n, k: sum(_rank_data(i, n, k)[0] for i in range(n)),
                  forbidden=("all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast",
                             "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                             "reduce_scatter_single"), algorithm=_ring_all_reduce_traffic)


def _bucket_model():
    """The model the one-bucket checker uses: four gradients of different shapes (212 floats)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


_NOT_ONE_ALL_REDUCE = ("reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
                       "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
                       "broadcast_object_list")


def _one_bucket_in_rank(fn):
    """Inside a rank: local gradients from this rank's shard, the true mean (computed with the
    real all_reduce before the learner's code runs), then fn(model) with dist.all_reduce
    wrapped to record every call's bytes and op."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _bucket_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)
    shard = slice(rank * 24 // world_size, (rank + 1) * 24 // world_size)
    torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    summed = [t.clone() for t in local]
    for t in summed:
        dist.all_reduce(t)
    calls, original = [], dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
        name = "SUM" if op == dist.ReduceOp.SUM else "AVG" if op == dist.ReduceOp.AVG else str(op).split(".")[-1]
        calls.append({"bytes": tensor.numel() * tensor.element_size(), "op": name})
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        with _noting_calls(_NOT_ONE_ALL_REDUCE) as others:   # any other collective or p2p call
            fn(model)
    finally:
        dist.all_reduce = original
    return {"calls": calls, "others": others, "local": local, "summed": summed,
            "got": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
            "shapes": [tuple(p.shape) for p in model.parameters()]}


def _close(a, b):
    return all(x is not None and x.shape == y.shape and torch.allclose(x, y, rtol=1e-5, atol=1e-7)
               for x, y in zip(a, b))


def _one_bucket_problem(result, world_size):
    """What is wrong on one rank, or None."""
    calls, got, summed = result["calls"], result["got"], result["summed"]
    grad_bytes = sum(t.numel() * t.element_size() for t in result["local"])
    if result["others"]:
        used = sorted(set(result["others"]), key=result["others"].index)
        return (f"you called {', '.join(f'dist.{name}' for name in used)} ({len(result['others'])} call(s)) "
                f"besides {len(calls)} all_reduce(s): even when the numbers come out right, that is more "
                f"collectives (and more waiting) than needed; one all_reduce of one flat buffer gives every "
                f"rank the sum at once")
    if not calls:
        return ("you never called dist.all_reduce: each rank still has only its own gradients; "
                "all_reduce the flat buffer once")
    if len(calls) > 1:
        return (f"you called all_reduce {len(calls)} times (once per parameter?): flatten all gradients "
                f"into one buffer and all_reduce it once")
    nbytes = calls[0]["bytes"]
    if nbytes != grad_bytes:
        what = ("not all gradients are in the buffer" if nbytes < grad_bytes
                else "more than the gradients: did you flatten something else too?")
        return (f"your all_reduce carried {nbytes} bytes, but the {len(got)} gradients are {grad_bytes} bytes "
                f"({grad_bytes // 4} floats): {what}")
    if calls[0]["op"] not in ("SUM", "AVG"):
        return (f"your all_reduce used {calls[0]['op']}: use op=dist.ReduceOp.SUM (the default), "
                f"then divide by the world size")
    for i, (g, shape) in enumerate(zip(got, result["shapes"])):
        if g is None:
            return f"parameter {i} has no .grad after your function: write its slice of the buffer back"
        if tuple(g.shape) != shape:
            return (f"parameter {i}: .grad has shape {tuple(g.shape)}, the parameter {shape}: "
                    f"reshape each slice with .view_as(p.grad)")
    mean = [t / world_size for t in summed]
    if _close(got, mean):
        return None
    if _close(got, result["local"]):
        return ("the .grad tensors still hold this rank's own gradients: copy the averaged buffer back "
                "into each p.grad (the flat buffer is a copy, not a view)")
    if _close(got, summed):
        return "the gradients are the sum over the ranks, not the mean: divide the buffer by dist.get_world_size()"
    if calls[0]["op"] == "AVG" and _close(got, [t / world_size for t in mean]):
        return "ReduceOp.AVG already divides by the world size: do not divide again"
    for k in range(2, 9):
        if k != world_size and _close(got, [t / k for t in summed]):
            return f"you divided by {k}, but the world size here is {world_size}: use dist.get_world_size()"
    for i, (g, want) in enumerate(zip(got, mean)):
        wrong = ((g - want).abs() > 1e-5 + 1e-4 * want.abs()).flatten().nonzero()
        if len(wrong):
            j = int(wrong[0])
            return (f"parameter {i} (shape {tuple(want.shape)}), element {j}: expected {want.flatten()[j].item():.6g}, "
                    f"got {g.flatten()[j].item():.6g} (slices copied back to the wrong parameters? keep the order "
                    f"of model.parameters() when you flatten and when you copy back)")
    return "the gradients differ from the mean over the ranks"


def check_one_bucket_average(fn):
    """Notebook 05: `fn(model)` replaces every gradient by its mean over the ranks with ONE
    all_reduce of one flat buffer. Checked on real ranks (2 and 3) with dist.all_reduce
    wrapped: the number of calls, the bytes each carried, and the gradients written back."""
    title = "average_gradients_one_bucket"
    problems = []
    for world_size in (2, 3):
        label = f"world_size={world_size}"
        try:
            results = launch(_one_bucket_in_rank, world_size, args=(fn,), timeout=20, quiet=True)
        except WorkerTimeout as err:
            problems.append(f"{label}: rank(s) {err.unfinished_ranks} never finished: every rank must call "
                            f"all_reduce the same number of times, with buffers of the same size")
            break
        except WorkerError as err:
            if err.exc_type == "NotImplementedError":
                return Verdict(title, [f"{fn.__name__} still raises NotImplementedError: fill in the stub"])
            first_line = str(err).splitlines()[0]
            if err.exc_type == "RuntimeError" and "gloo" in first_line.lower():
                problems.append(f"{label}: rank {err.rank} failed inside Gloo (its partner had left): did every "
                                f"rank call all_reduce the same number of times, with buffers of the same size?")
            else:
                problems.append(f"{label}: {first_line[:300]}")
            continue
        wrong = {rank: problem for rank, result in enumerate(results)
                 if (problem := _one_bucket_problem(result, world_size))}
        if wrong and len(wrong) < world_size:
            rank, problem = next(iter(wrong.items()))
            right = [r for r in range(world_size) if r not in wrong]
            problems.append(f"{label}: ranks disagree (rank(s) {right} right, rank {rank} not): {problem}")
        elif wrong:
            problems.append(f"{label}, rank 0: {wrong[0]}")
    return Verdict(title, problems)


_STEP_CASES = [(10_000, 128, 1), (10_000, 128, 2), (998, 111, 3), (50_000, 256, 8), (1_000, 64, 7),
               (1_000, 64, 2), (11, 3, 4)]   # 500/64 = 7.8: rounding is not the rule; 11 on 4 ranks: padding


STEPS_TIMEOUT_S = 20   # the learner's steps_per_epoch is arithmetic: this is an endless loop


def _steps_in_rank(fn, cases):
    """Inside a rank, a fresh process that nothing the notebook patched reaches: first the expected
    steps per epoch of every case, from torch's DataLoader over a DistributedSampler as notebook 06
    builds them (drop_last=True), before any learner code runs; then fn for each case. Returns
    [(want, what fn did)]: ("int", steps), ("other", repr, type name) or ("raised", type, message),
    or None when fn is still the stub."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    wants = []
    for n, batch, world_size in cases:
        images = TensorDataset(torch.zeros(n, 1, dtype=torch.uint8))
        sampler = DistributedSampler(images, num_replicas=world_size, rank=0, shuffle=True, seed=0)
        wants.append(len(DataLoader(images, batch, sampler=sampler, drop_last=True)))
    found = []
    for (n, batch, world_size), want in zip(cases, wants):
        try:
            got = fn(n, batch, world_size)
        except NotImplementedError:
            return None
        except (Exception, SystemExit) as exc:
            found.append((want, ("raised", type(exc).__name__, str(exc)[:200])))
            continue
        if isinstance(got, int) and not isinstance(got, bool):
            found.append((want, ("int", int(got))))
        else:
            found.append((want, ("other", repr(got)[:100], type(got).__name__)))
    return found


def check_steps_per_epoch(fn):
    """Notebook 06: `fn(n_images, batch_per_rank, world_size)` is the number of training steps
    per epoch each rank takes with DistributedSampler and DataLoader(..., drop_last=True).

    fn runs in a rank of its own (one `launch`, at most STEPS_TIMEOUT_S): an endless loop, sys.exit
    or a crash is a verdict, and what fn patches stays there. The expected values come from torch's
    DataLoader and DistributedSampler, in that rank, before fn runs."""
    title = "steps_per_epoch"
    name = getattr(fn, "__name__", "the function")
    if not callable(fn):
        return Verdict(title, [f"expected a function steps_per_epoch(n_images, batch_per_rank, world_size), "
                               f"got {type(fn).__name__}"])
    try:
        found = launch(_steps_in_rank, 1, args=(fn, _STEP_CASES), timeout=STEPS_TIMEOUT_S, init=False,
                       quiet=True)[0]
    except WorkerTimeout:
        return Verdict(title, [f"{name} did not return within {STEPS_TIMEOUT_S:g} s (an endless loop?)"])
    except WorkerError as err:
        return Verdict(title, [f"{name} ended its process: {str(err).splitlines()[0][:300]}"])
    except Exception as err:   # fn could not be sent to a rank (pickling)
        return Verdict(title, [f"could not run {name}: {type(err).__name__}: {str(err)[:300]}"])
    if found is None:
        return Verdict(title, [f"{name} still raises NotImplementedError: fill in the stub"])
    problems = []
    for (n, batch, world_size), (want, (kind, *what)) in zip(_STEP_CASES, found):
        label = f"{n} images, {batch} per rank, {world_size} ranks"
        if kind == "raised":
            exc_type, message = what
            exit_hint = ": return the number instead of ending the program" if exc_type == "SystemExit" else ""
            problems.append(f"{label}: {name} raised {exc_type}: {message}{exit_hint}")
        elif kind == "other":
            shown, type_name = what
            problems.append(f"{label}: expected a whole number of steps (an int), got {shown} "
                            f"({type_name}): use // for whole divisions")
        elif what[0] != want:
            got = what[0]
            per_rank = -(-n // world_size)
            hint = ("; each rank gets ceil(n / world_size) = "
                    f"{per_rank} images (DistributedSampler pads), and the last incomplete batch is dropped"
                    if got in (round(n / world_size / batch), n // world_size // batch, -(-per_rank // batch)) else "")
            problems.append(f"{label}: expected {want} steps, got {got!r}{hint}")
    return Verdict(title, problems)


def _torchrun_config_problems(run, args):
    """What torchrun itself would refuse when it turns the parsed flags into its agent's settings
    (run.config_from_args), without touching this process's environment or log."""
    import os
    saved, was_disabled = dict(os.environ), run.logger.disabled
    run.logger.disabled = True   # its warnings (OMP_NUM_THREADS, ...) are not the learner's problem
    try:
        run.config_from_args(args)
    except (ValueError, AssertionError, RuntimeError) as err:
        return [f"torchrun would stop before starting anything: {err}"]
    finally:
        run.logger.disabled = was_disabled
        os.environ.clear()
        os.environ.update(saved)   # config_from_args sets OMP_NUM_THREADS
    return []


def check_torchrun_command(command):
    """Notebook 11: the one torchrun command for every node of a job of 2 nodes x 4 GPUs that
    meets at node01:29500 through the c10d rendezvous, restarts up to 3 times, and trains with
    `-m ddp_helpers.train --checkpoint ckpt/epoch-{epoch}.pt --resume auto`.
    Parsed with torchrun's own argument parser. Pure text: no ranks needed."""
    import contextlib
    import io
    import shlex
    from torch.distributed import run
    title = "torchrun command"
    if not isinstance(command, str) or not command.strip() or "..." in command:
        return Verdict(title, ["still the stub: write the whole command as one string"])
    try:
        words = shlex.split(command)
    except ValueError as err:
        return Verdict(title, [f"cannot split it like a shell would: {err}"])
    if "torch.distributed.launch" in words:
        return Verdict(title, ["python -m torch.distributed.launch is deprecated: use torchrun"])
    setting = [w for w in words if "=" in w and w.split("=")[0] in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")]
    if setting:
        return Verdict(title, [f"{setting[0]}: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and the store's "
                               f"address for every worker; do not set them yourself"])
    if words[0] == "torchrun":
        words = words[1:]
    elif words[1:3] == ["-m", "torch.distributed.run"]:
        words = words[3:]
    else:
        return Verdict(title, [f"start with torchrun (or python -m torch.distributed.run), not {words[0]!r}"])
    parser, errors = run.get_args_parser(), io.StringIO()
    parser.prog = "torchrun"
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(words)
    except SystemExit:
        refusal = errors.getvalue().strip().splitlines()[-1]
        hint = (" (options before the program are torchrun's; the program's own go after it)"
                if "unrecognized arguments" in refusal else "")
        return Verdict(title, [f"torchrun would refuse it: {refusal}{hint}"])
    problems = _torchrun_config_problems(run, args)
    if args.standalone:
        problems.append("--standalone is for one node only: it starts its own rendezvous on this machine")
    if args.nnodes not in ("2", "2:2"):
        problems.append(f"--nnodes should be 2 (the number of machines), got {args.nnodes}")
    if args.nproc_per_node != "4":
        hint = ": it counts the processes on each node, not in the whole job" if args.nproc_per_node == "8" else ""
        problems.append(f"--nproc-per-node should be 4 (one process per GPU), got {args.nproc_per_node}{hint}")
    if args.rdzv_backend != "c10d":
        problems.append(f"--rdzv-backend should be c10d, got {args.rdzv_backend}")
    if args.rdzv_endpoint != "node01:29500":
        problems.append(f"--rdzv-endpoint should be node01:29500 (the head node, where the agents meet), "
                        f"got {args.rdzv_endpoint or 'nothing'}")
    if any(w.split("=")[0] in ("--node-rank", "--node_rank") for w in words[:words.index(args.training_script)]):
        problems.append("leave out --node-rank: with c10d torchrun ignores it (each node's GROUP_RANK comes from "
                        "the rendezvous), and without it the command is the same on every node")
    if args.max_restarts != 3:
        problems.append(f"--max-restarts should be 3, got {args.max_restarts}")
    program = args.training_script_args
    if not (args.module and args.training_script == "ddp_helpers.train"):
        problems.append(f"run the module: -m ddp_helpers.train (got {'-m ' if args.module else ''}{args.training_script})")
    for flag, value in (("--checkpoint", "ckpt/epoch-{epoch}.pt"), ("--resume", "auto")):
        if flag not in program or program.index(flag) + 1 >= len(program) or program[program.index(flag) + 1] != value:
            problems.append(f"pass {flag} {value} to the training program, after the module name "
                            f"(options before it are torchrun's)")
    return Verdict(title, problems)


_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
                "all_gather_object", "broadcast_object_list", "gather_object", "send", "recv", "isend", "irecv")


_STILL_A_STUB = "the learner's stub still raises NotImplementedError"


def _launch_case(in_rank, world_size, args, label, timeout, never_finished, partner_left):
    """One case of a checker: `in_rank(*args)` on `world_size` Gloo ranks. Returns (results, None,
    False); or (None, what went wrong, stuck): ranks that never finished (stuck: `never_finished`
    says why), a rank that failed (with `partner_left` when Gloo says its peer went away), or
    _STILL_A_STUB."""
    try:
        return launch(in_rank, world_size, args=args, timeout=timeout, quiet=True), None, False
    except WorkerTimeout as err:
        return None, f"{label}: rank(s) {err.unfinished_ranks} never finished: {never_finished}", True
    except WorkerError as err:
        if err.exc_type == "NotImplementedError":
            return None, _STILL_A_STUB, False
        first_line = str(err).splitlines()[0].split(". This is typically")[0][:300]
        hint = partner_left if "gloo" in first_line.lower() or "closed" in first_line.lower() else ""
        return None, f"{label}: rank {err.rank} failed: {first_line}{hint}", False


def _mean_loss_in_rank(fn):
    """Inside a rank: fn(loss) with this rank's loss, every collective wrapped to note its name
    (outermost calls only). Returns (fn's result, the names in call order, what fn printed)."""
    import io
    printed = io.StringIO()
    with _noting_calls(_COLLECTIVES) as calls, contextlib.redirect_stdout(printed):
        result = fn(1.0 + dist.get_rank())
    return result, calls, printed.getvalue()


@contextlib.contextmanager
def _noting_calls(names, describe=None):
    """Inside a rank: while the block runs, each dist.<name> that exists notes its name, in call order
    (the outermost call only: a collective built from others is noted once). Yields that list.
    describe(name, args, kwargs), if given, makes the note instead of the bare name."""
    calls, inside = [], []
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def noting(name):
        def call(*args, **kwargs):
            if not inside:
                calls.append(describe(name, args, kwargs) if describe else name)
            inside.append(name)
            try:
                return saved[name](*args, **kwargs)
            finally:
                inside.pop()
        return call

    for name in saved:
        setattr(dist, name, noting(name))
    try:
        yield calls
    finally:
        for name, call in saved.items():
            setattr(dist, name, call)


def check_mean_loss(fn):
    """Notebook 12: `fn(loss)` returns the mean of every rank's loss on every rank, and only rank 0
    prints it. Checked on 2 and 3 ranks: the values, who printed, and that every rank called the same
    collectives in the same order (the bug of the exercise: a collective inside `if rank == 0`)."""
    title = "mean_loss"
    problems = []
    for world_size in (2, 3):
        label = f"world_size={world_size}"
        want = sum(1.0 + r for r in range(world_size)) / world_size
        results, problem, stuck = _launch_case(
            _mean_loss_in_rank, world_size, (fn,), label, timeout=10,
            never_finished="they wait in a collective that another rank never calls. Is a collective inside "
                           "`if dist.get_rank() == 0`? Every rank must call every collective; only the print "
                           "belongs in the if",
            partner_left=": its partner had left without joining the collective. Is a collective inside "
                         "`if dist.get_rank() == 0`? Every rank must call every collective")
        if problem is _STILL_A_STUB:
            return Verdict(title, [f"{fn.__name__} still raises NotImplementedError: fill in the stub"])
        if problem:
            problems.append(problem)
            if stuck:
                break
            continue
        sequences = [calls for _, calls, _ in results]
        if any(seq != sequences[0] for seq in sequences):
            rank = next(r for r, seq in enumerate(sequences) if seq != sequences[0])
            problems.append(f"{label}: rank 0 called {sequences[0] or 'no collective'}, rank {rank} called "
                            f"{sequences[rank] or 'no collective'}: every rank must call the same collectives in "
                            f"the same order (a mismatch hangs, or mixes up data)")
            continue
        for rank, (value, _, _) in enumerate(results):
            if not isinstance(value, (int, float)) or abs(value - want) > 1e-6:
                problems.append(f"{label}, rank {rank}: expected the mean loss {want:g}, got {value!r}"
                                + (" (the sum: divide by dist.get_world_size())"
                                   if isinstance(value, (int, float)) and abs(value - want * world_size) < 1e-6 else ""))
                break
        printers = [rank for rank, (_, _, out) in enumerate(results) if out.strip()]
        if printers != [0]:
            problems.append(f"{label}: rank(s) {printers or 'none'} printed; only rank 0 should print the mean")
    return Verdict(title, problems)


# ------------------------------------------------------------------ notebook 07: a compression comm hook
_FP16_MAX = 65504.0


def _hook_model():
    """The model the hook checker uses: 2 buckets' worth of gradients (bucket_cap_mb below)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _compress_hook_in_rank(hook, scale):
    """Inside a rank: this rank's gradients (a loss times `scale`), their true mean in float32 (the
    real all_reduce, before the learner's code runs), then one backward of the same loss through DDP
    with `hook` registered, every dist.all_reduce noted (dtype, bytes) and any other collective named."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 32, generator=g), torch.randn(24, 8, generator=g)
    shard = slice(rank * 24 // world_size, (rank + 1) * 24 // world_size)

    def loss_of(model):
        return scale * (model(x[shard]) - y[shard]).square().sum()

    plain = _hook_model()
    loss_of(plain).backward()
    local = [p.grad.clone() for p in plain.parameters()]
    mean = [t.clone() for t in local]
    for t in mean:
        dist.all_reduce(t)
        t /= world_size
    model = DDP(_hook_model(), bucket_cap_mb=0.004)   # 4 KB: the gradients travel in 2 buckets
    model.register_comm_hook(None, hook)
    calls, original = [], dist.all_reduce

    def noting_all_reduce(tensor, *args, **kwargs):
        calls.append({"dtype": str(tensor.dtype).replace("torch.", ""), "bytes": tensor.numel() * tensor.element_size()})
        return original(tensor, *args, **kwargs)

    error = None
    dist.all_reduce = noting_all_reduce
    try:
        with _noting_calls(_NOT_ONE_ALL_REDUCE) as others:
            loss_of(model).backward()
    except Exception as err:            # a hook's error surfaces from backward(), often wrapped
        error = f"{type(err).__name__}: {err}"
    finally:
        dist.all_reduce = original
    return {"error": error, "calls": calls, "others": others, "local": local, "mean": mean,
            "got": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
            "grad_bytes": sum(t.numel() * t.element_size() for t in local)}


def _compress_problem(result, world_size, overflow_case):
    """What is wrong on one rank, or None."""
    if result["others"]:
        used = sorted(set(result["others"]), key=result["others"].index)
        return (f"your hook called {', '.join(f'dist.{name}' for name in used)}: one all_reduce of the "
                f"compressed bucket is all it needs")
    calls = result["calls"]
    if not calls:
        return ("no dist.all_reduce was called: the hook must all-reduce the compressed bucket "
                "(dist.all_reduce(compressed, async_op=True).get_future())")
    sent, full = sum(c["bytes"] for c in calls), result["grad_bytes"]
    dtypes = sorted({c["dtype"] for c in calls})
    if dtypes != ["float16"]:
        return (f"your all_reduce(s) sent {', '.join(dtypes)} tensors ({sent} bytes for {full} bytes of float32 "
                f"gradients): compress each bucket to torch.float16 first, half the bytes")
    if sent != full // 2:
        return (f"your all_reduce(s) sent {sent} bytes; the gradients in float16 are {full // 2} bytes "
                f"(each bucket once)")
    got, mean, local = result["got"], result["mean"], result["local"]
    if any(g is None for g in got):
        return "a parameter has no .grad after backward: return a future whose value is the bucket's float32 tensor"

    def close(a, b, rtol=4e-3):
        return all(x.shape == y.shape and torch.isfinite(x).all() and
                   torch.allclose(x.float(), y, rtol=rtol, atol=rtol * y.abs().max().item()) for x, y in zip(a, b))

    if close(got, mean):
        return None
    if any(not torch.isfinite(g).all() for g in got):
        return ("the averaged gradients hold inf: the sum over the ranks overflowed float16 (largest value "
                f"{_FP16_MAX:g}); divide by the world size BEFORE the all-reduce, so the sum is already a mean"
                if overflow_case else "the averaged gradients hold inf or nan")
    if close(got, [t * world_size for t in mean]):
        return "the gradients are the sum over the ranks, not the mean: divide by dist.get_world_size()"
    if close(got, local):
        return ("the gradients are still this rank's own: the future's value must be the all-reduced bucket, "
                "cast back to float32")
    return "the gradients differ from the mean over the ranks by more than float16's rounding"


def check_fp16_compress_hook(hook):
    """Notebook 07: `hook(state, bucket)`, a DDP comm hook that averages each bucket's gradients in
    float16. Run by DDP on real ranks (2 and 3) with dist.all_reduce wrapped: the dtype and bytes
    sent (half of float32's, each bucket once), the averaged gradients against the true mean (within
    float16's rounding), and one case whose sum overflows float16 while its mean does not."""
    title = hook.__name__ if callable(hook) else "hook"
    if not callable(hook):
        return Verdict(title, [f"expected a function hook(state, bucket), got {type(hook).__name__}"])
    problems = []
    for world_size, scale in ((2, 1.0), (3, 1.0), (2, None)):
        overflow_case = scale is None
        label = f"world_size={world_size}" + (", gradients near float16's limit" if overflow_case else "")
        if overflow_case:   # each rank's gradients just inside float16's range, their sum beyond it
            largest_own, largest_sum = _largest_gradients(world_size)
            scale = 0.95 * _FP16_MAX / largest_own
            assert largest_sum * scale > 1.1 * _FP16_MAX, "the checker's data no longer overflows float16"
        try:
            results = launch(_compress_hook_in_rank, world_size, args=(hook, scale), timeout=30, quiet=True)
        except WorkerTimeout as err:
            problems.append(f"{label}: rank(s) {err.unfinished_ranks} never finished: every rank's hook must "
                            f"all-reduce each bucket once")
            break
        except WorkerError as err:
            problems.append(f"{label}: {str(err).splitlines()[0][:300]}")
            continue
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            if "NotImplementedError" in errors[0]:
                return Verdict(title, [f"{title} still raises NotImplementedError: fill in the stub"])
            problems.append(f"{label}: backward() failed in your hook: {errors[0].splitlines()[0][:300]}")
            continue
        wrong = {rank: p for rank, r in enumerate(results) if (p := _compress_problem(r, world_size, overflow_case))}
        if wrong:
            rank, problem = next(iter(wrong.items()))
            problems.append(f"{label}, rank {rank}: {problem}")
    return Verdict(title, problems)


def _largest_gradients(world_size):
    """The largest |gradient| of any rank, and the largest |sum over the ranks| of a gradient, with
    scale 1 (the checker's data is fixed)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 32, generator=g), torch.randn(24, 8, generator=g)
    own = []
    for rank in range(world_size):
        model = _hook_model()
        shard = slice(rank * 24 // world_size, (rank + 1) * 24 // world_size)
        (model(x[shard]) - y[shard]).square().sum().backward()
        own.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return max(g.abs().max().item() for g in own), sum(own).abs().max().item()


# ---- Notebook 04: timing an all-reduce, and predicting one ------------------------------------
_CLOCKS = ("perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns", "time_ns")


def _op_name(op):
    return "SUM" if op == dist.ReduceOp.SUM else "AVG" if op == dist.ReduceOp.AVG else str(op).split(".")[-1]


def _timing_in_rank(fn, nbytes, iters, warmup):
    """Inside a rank: fn(nbytes, iters, warmup) with every collective and the clocks of `time` wrapped to
    write down, in order, what this rank's thread does: each collective (an all_reduce with its bytes, its
    op, and for a small tensor its values before and after), each clock reading. Returns (result, events)."""
    import threading
    import time
    me, events, inside = threading.get_ident(), [], []
    saved_dist = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    saved_time = {name: getattr(time, name) for name in _CLOCKS}

    def collective(name):
        real = saved_dist[name]

        def call(*args, **kwargs):
            if inside or threading.get_ident() != me:
                return real(*args, **kwargs)
            event = {"kind": name}
            tensor = args[0] if args else kwargs.get("tensor")
            if name == "all_reduce" and isinstance(tensor, torch.Tensor):
                op = args[1] if len(args) > 1 else kwargs.get("op", dist.ReduceOp.SUM)
                event.update(bytes=tensor.numel() * tensor.element_size(), op=_op_name(op))
                if tensor.numel() <= 8:
                    event["before"] = tensor.detach().double().flatten().tolist()
            events.append(event)
            inside.append(name)
            try:
                return real(*args, **kwargs)
            finally:
                inside.pop()
                if "before" in event:
                    event["after"] = tensor.detach().double().flatten().tolist()
        return call

    def clock(name):
        real = saved_time[name]

        def read():
            value = real()
            if not inside and threading.get_ident() == me:
                events.append({"kind": "clock", "seconds": value / 1e9 if name.endswith("_ns") else value})
            return value
        return read

    for name in saved_dist:
        setattr(dist, name, collective(name))
    for name in saved_time:
        setattr(time, name, clock(name))
    try:
        result = fn(nbytes, iters, warmup)
    finally:
        for name, real in saved_dist.items():
            setattr(dist, name, real)
        for name, real in saved_time.items():
            setattr(time, name, real)
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    return result, events


def _timing_order_problem(events, nbytes, iters, warmup):
    """What is wrong with the order of one rank's calls, or None; and the seconds per call its clock
    readings around the timed calls give (None where no clock of `time` was seen)."""
    others = [e["kind"] for e in events if e["kind"] not in ("all_reduce", "barrier", "clock")]
    if others:
        return (f"you called dist.{others[0]}: timing an all-reduce needs only dist.all_reduce and "
                f"dist.barrier (the mean over ranks is an all_reduce too)"), None
    payload = [i for i, e in enumerate(events) if e["kind"] == "all_reduce" and e.get("bytes") == nbytes]
    if not payload:
        sizes = sorted({e.get("bytes") for e in events if e["kind"] == "all_reduce"})
        return (f"no all_reduce of {nbytes} bytes" + (f" (yours carried {sizes} bytes)" if sizes else "")
                + f": all_reduce a tensor of nbytes // 4 = {nbytes // 4} float32 elements, e.g. "
                  f"torch.ones(nbytes // 4)"), None
    barriers = [i for i, e in enumerate(events) if e["kind"] == "barrier" and i < payload[-1]]
    if not barriers:
        return ("no dist.barrier() before the timed calls: the ranks do not start together, and a rank that "
                "arrives first times its wait for the others. Call dist.barrier() after the warm-up, then "
                "start the clock"), None
    start_line = barriers[-1]
    warm = [i for i in payload if i < start_line]
    timed = [i for i in payload if i > start_line]
    if not warm:
        return ("no warm-up: no all_reduce before dist.barrier(). The first calls of a process pay one-time "
                "costs (first use of the connections, buffers, pages): make `warmup` untimed calls first, "
                "then the barrier, then the clock"), None
    if not timed:
        return "no all_reduce after dist.barrier(): time `iters` calls after it", None
    clocks = [i for i, e in enumerate(events) if e["kind"] == "clock"]
    per_call = None
    if clocks:
        before = [i for i in clocks if i < timed[0]]
        after = [i for i in clocks if i > timed[-1]]
        if not before or before[-1] < start_line:
            return ("the clock starts before dist.barrier(): a rank that reaches the barrier first would time "
                    "its wait for the others. Read the clock after the barrier, just before the timed calls"), None
        if not after:
            return "no clock reading after the last timed call: read the clock again when the calls are done", None
        per_call = (events[after[0]]["seconds"] - events[before[-1]]["seconds"]) / iters
    if len(warm) != warmup:
        return (f"{len(warm)} warm-up all_reduce(s) before the barrier, but the checker asked for "
                f"warmup={warmup}: use the argument"), per_call
    if len(timed) != iters:
        return (f"{len(timed)} timed all_reduce(s) after the barrier, but the checker asked for iters={iters}: "
                f"use the argument"), per_call
    return None, per_call


def _near(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _timing_mean_problem(runs, world_size, iters):
    """What is wrong with the mean over ranks (the same number on every rank, the mean of each rank's
    seconds per call), or None."""
    results = [result for result, _, _ in runs]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in results):
        bad = next(r for r in results if not isinstance(r, (int, float)) or isinstance(r, bool))
        return f"return a number, the mean seconds per call; got {bad!r} ({type(bad).__name__})"
    if not all(math.isfinite(r) and r > 0 for r in results):
        return f"the time per call must be a positive number of seconds; got {results}"
    if any(not _near(r, results[0], 1e-9) for r in results):
        shown = ", ".join(f"rank {rank} {value:.6g} s" for rank, value in enumerate(results))
        return (f"the ranks returned different times ({shown}): each rank returned its own. The mean over ranks: "
                f"put this rank's seconds per call in a tensor, dist.all_reduce it (a sum) and divide by "
                f"dist.get_world_size(), so that every rank returns the same number")
    means = [next((e for i, e in reversed(list(enumerate(events))) if e["kind"] == "all_reduce" and "after" in e), None)
             for _, events, _ in runs]
    if any(m is None for m in means):
        return ("every rank returned the same time, but not through an all_reduce of the ranks' times: "
                "all_reduce a tensor holding this rank's seconds per call, then divide by the world size")
    mine = [m["before"][0] for m in means]
    total = means[0]["after"][0]
    want = total if means[0]["op"] == "AVG" else total / world_size
    got = results[0]
    if not _near(got, want):
        if means[0]["op"] == "SUM" and _near(got, total):
            return (f"you returned the sum of the ranks' times ({got:.6g} s): divide it by "
                    f"dist.get_world_size() = {world_size}")
        for k in range(1, 9):
            if k != world_size and _near(got, total / k):
                return f"you divided by {k}, but the world size here is {world_size}: use dist.get_world_size()"
        return (f"you returned {got:.6g} s, but the all_reduce of the ranks' times gave {total:.6g} s "
                f"over {world_size} ranks: return their mean, {want:.6g} s")
    for rank, (value, (_, _, per_call)) in enumerate(zip(mine, runs)):
        if per_call is None or _near(value, per_call, 0.2):
            continue
        if _near(value, per_call * iters, 0.2):
            return (f"rank {rank}'s time is for all {iters} calls together ({value:.6g} s): divide by iters for "
                    f"the time per call")
        if _near(value, per_call * 1e6, 0.2) or _near(value, per_call * 1e3, 0.2):
            return f"rank {rank} gave {value:.6g}: return seconds per call (the clock's unit), not µs or ms"
        return (f"rank {rank}'s time per call is {value:.6g} s, but its clock readings around the timed calls "
                f"give {per_call:.6g} s per call: time from just before the first timed call to just after the last")
    return None


def check_all_reduce_timing(fn, predicted_us, nbytes=3 * 2**20, iters=20, warmup=5, tolerance=3.0):
    """Notebook 04: `fn(nbytes, iters, warmup)`, run on every rank, returns the seconds per dist.all_reduce
    of `nbytes` bytes of float32, the mean over the ranks, timed as nccl-tests times it; `predicted_us` is
    the alpha-beta model's time for that size, in µs.

    Runs fn on 2 and 3 Gloo ranks with every collective and the clocks of `time` wrapped, and checks the
    algorithm on each rank: `warmup` all_reduces of `nbytes` bytes, then dist.barrier(), then the clock,
    then `iters` all_reduces, then the clock, then one all_reduce of the time; every rank returns the same
    mean. Then compares the prediction with the 2-rank measurement, loosely (within a factor of
    `tolerance` either way: times on a busy machine vary). Reference solution:
    ddp_helpers/solutions.py, my_all_reduce_time."""
    from .. import bench
    from ..bench_plots import human_bytes
    title = "my_all_reduce_time"
    if not (isinstance(nbytes, int) and nbytes >= 4 and isinstance(iters, int) and iters >= 1
            and isinstance(warmup, int) and warmup >= 1):
        raise ValueError(f"need nbytes >= 4, iters >= 1 and warmup >= 1 (whole numbers), "
                         f"got {nbytes!r}, {iters!r}, {warmup!r}")
    problems, notes, measured_us = [], [], None
    for world_size in (2, 3):
        label = f"world_size={world_size}"
        runs, problem, stuck = _launch_case(
            _timing_in_rank, world_size, (fn, nbytes, iters, warmup), label, timeout=30,
            never_finished="they wait in a collective another rank never calls. Every rank must make the "
                           "same calls: the warm-up, the barrier, the timed all_reduces and the all_reduce "
                           "of the time",
            partner_left=": its partner had left. Does every rank make the same calls, the same number of times?")
        if problem is _STILL_A_STUB:
            return Verdict(title, [f"{fn.__name__} still raises NotImplementedError: fill in the stub"])
        if problem:
            problems.append(problem)
            if stuck:
                break
            continue
        checked = []
        for rank, (result, events) in enumerate(runs):
            problem, per_call = _timing_order_problem(events, nbytes, iters, warmup)
            if problem:
                problems.append(f"{label}, rank {rank}: {problem}")
                break
            checked.append((result, events, per_call))
        else:
            problem = _timing_mean_problem(checked, world_size, iters)
            if problem:
                problems.append(f"{label}: {problem}")
            elif world_size == 2:
                measured_us = checked[0][0] * 1e6
        if problems:
            break
    if measured_us is not None:
        busbw = bench.busbw_GBps("all_reduce", nbytes, measured_us, 2)
        notes.append(f"measured: all_reduce of {human_bytes(nbytes)} on 2 Gloo ranks, {measured_us:,.0f} µs per "
                     f"call (algbw = busbw = {busbw:.2f} GB/s)")
    if not isinstance(predicted_us, (int, float)) or isinstance(predicted_us, bool) or not predicted_us > 0:
        problems.append(f"my_prediction_us is {predicted_us!r}: set it to the model's time for "
                        f"{nbytes:,} B, t = α + S/β in µs (β in GB/s is 1e3 bytes per µs)")
    elif measured_us is not None:
        ratio = predicted_us / measured_us
        notes.append(f"predicted: {predicted_us:,.0f} µs, {ratio:.2f}× the measurement")
        if not 1 / tolerance <= ratio <= tolerance:
            unit = next((name for factor, name in ((1e3, "ms"), (1e-3, "ms"), (1e6, "s"), (1e-6, "s"))
                         if 1 / 3 <= ratio / factor <= 3), None)
            hint = (f"a unit slip? It is off by about {'1e3' if unit == 'ms' else '1e6'}: α is in µs, "
                    f"S in bytes, β in GB/s = 1e3 bytes per µs" if unit else
                    "check t = α + S/β: α in µs, S in bytes, β in GB/s = 1e3 bytes per µs (if it still misses, "
                    "the machine may be busier now than during the sweep: run both again)")
            problems.append(f"your prediction is {ratio:.2f}× the measurement, more than {tolerance:g}× off: "
                            f"{hint}")
    return Verdict(title, problems, notes)


# Checkers grouped by notebook, each in its own module (they use Verdict and the helpers above).
from .welcome import *            # noqa: E402,F401,F403  notebook 00
from .ddp_cifar10 import *        # noqa: E402,F401,F403  notebook 06
from .tensor_parallel import *    # noqa: E402,F401,F403  notebook 09
from .pipeline_context import *   # noqa: E402,F401,F403  notebook 10
