"""Imported by the fork server (`forkserver.PRELOAD`): what ranks that train import, torch._dynamo (every
optimizer and DDP imports it) and torchvision (the models and transforms; it imports torch._dynamo too),
unless the server keeps bytecode in its private cache (`bytecode_cache`) and they are not in it yet.

The server imports them once for all its ranks. From source, though (a fresh machine whose image ships
torch without bytecode), they take as long as torch itself, and the first launch of the first kernel
would wait for them even if it trains nothing. Then the server leaves them out: the first rank that
trains imports them and writes their bytecode into the cache, and the servers after it read them from
there. Where nothing would keep the bytecode (no cache), the server imports them as before: once in the
server rather than in every rank.
"""
from . import bytecode_cache, forkserver


def _compiled(module: str) -> bool:
    return forkserver.BYTECODE_CACHE is None or bytecode_cache.has_bytecode(module)


if _compiled("torch._dynamo"):
    import torch._dynamo  # noqa: F401
    if _compiled("torchvision"):   # it imports torch._dynamo: never before it
        import torchvision  # noqa: F401
