"""What this rank stores of a tensor: a DTensor's local shard (FSDP2, tensor parallelism), any other tensor itself.

One spelling of DTensor's private ``_local_tensor`` for every module that counts or reduces a rank's own part:
``to_local()`` would do, but it is an autograd op, and these readers run outside autograd and on plain tensors
alike."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def local_shard(t: Any) -> Any:
    """This rank's part of ``t``: a DTensor's local shard, a plain tensor itself."""
    return getattr(t, "_local_tensor", t)


def local_shards(tensors: Iterable[Any]) -> list[Any]:
    """``local_shard`` of each tensor."""
    return [local_shard(t) for t in tensors]
