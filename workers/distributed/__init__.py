"""Tensor parallelism in the engine: the rank processes of one worker and the lockstep that keeps them together.

Rank 0 (the leader) is the caller's runner; ranks 1 … T-1 (followers) are processes it spawns (`launch.py`), each
running the same `ModelRunner` and `Scheduler` code on its shard (`follower.py`). The leader alone samples, accepts
and drafts; it sends those decisions and the request stream over an ordered control channel (`channel.py`), and the
followers replay them (`lockstep.py`), so every rank runs the same forwards and the same collectives in order.
"""

from workers.distributed.channel import RankDivergence
from workers.model.distributed.group import RankFailure

__all__ = ["RankDivergence", "RankFailure"]
