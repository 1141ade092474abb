"""A follower rank's process: join the group, load this rank's shard through the runner class, then replay the
leader's request stream until it says `close` (or its pipe ends: the leader is gone).

The loop mirrors the leader's state-changing calls one for one (`add`, `step`, `score`, `reset`); inside a step the
scheduler reads the leader's decisions from the same pipe (`workers/distributed/lockstep.py`). A follower that fails
tells the leader why and exits, so the leader raises instead of waiting on it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from workers.config import EngineConfig
from workers.distributed.channel import ABORT, FollowerChannel, StepAborted
from workers.distributed.lockstep import Lockstep
from workers.model.distributed.group import make_group
from workers.requests import Request
from workers.samples import group_requests

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class LoadSpec:
    """What a follower needs to load its rank: picklable, no tokenizer or model objects."""

    path: str  # the model directory or hub repo id, as the caller gave it
    config: EngineConfig
    device: str  # "cpu" or "cuda" (rank r then uses cuda:r)
    num_threads: int  # torch threads of each follower (CPU)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (the pipe's EOF is the second guard)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the pipe's EOF still ends the loop


def follower_main(rank: int, spec: LoadSpec, store_path: str, connection: Connection, runner_class: Any) -> None:
    """A spawned follower's body: set up, join the group, load rank `rank` (`runner_class._load_rank`), serve."""
    die_with_parent()
    channel = FollowerChannel(connection)
    parallel = spec.config.parallel
    try:
        torch.set_num_threads(spec.num_threads)
        if spec.device == "cuda":
            torch.cuda.set_device(rank)
        channel.ready()
        group = make_group(store_path, rank, parallel.tensor_parallel_size, spec.device, parallel.rank_timeout_s)
        lockstep = Lockstep(rank, parallel.tensor_parallel_size, group, follower=channel)
        runner = runner_class._load_rank(spec.path, spec.config, lockstep)
    except BaseException as error:
        channel.report(error)
        os._exit(1)
    serve(runner, channel, rank)
    os._exit(0)  # no interpreter teardown (seconds of it); the leader closes the group's connections after


def serve(runner: Any, channel: FollowerChannel, rank: int) -> None:
    """Replay the leader's messages on `runner` until `close`; on the leader's EOF, or a failure here (reported
    up the pipe first), exit at once."""
    while True:
        try:
            tag, value = channel.next()
        except (EOFError, OSError):
            os._exit(1)  # the leader is gone
        try:
            if tag == "close":
                return
            _handle(runner, tag, value, rank)
        except StepAborted:
            continue  # the leader's step failed; it resets next
        except BaseException as error:
            channel.report(error)
            os._exit(1)


def _handle(runner: Any, tag: str, value: Any, rank: int) -> None:
    """One of the leader's calls, replayed."""
    if tag == "add":
        samples = [
            Request(index, prompt, params, stop_ids, _generator(runner, index), max_model_len, sample_index=j)
            for index, prompt, params, stop_ids, max_model_len, j in value
        ]
        runner._engine().add([group_requests(samples)])
    elif tag == "step":
        scheduler = runner._scheduler
        scheduler.step()
        runner._check_capture(scheduler)
        scheduler.take_finished()
    elif tag == "score":
        runner._scorer.score(value)
    elif tag == "reset":
        runner.reset()
    elif tag == "die" and value == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    elif tag == "call":  # tests: run a function on this rank's runner
        value(runner)
    elif tag not in (ABORT, "die"):
        raise ValueError(f"unknown message {tag!r} from the leader")


def _generator(runner: Any, index: int) -> torch.Generator:
    """A follower request's own generator. Only an MTP head's replayed drafts of sampled rows draw from it (they
    are discarded: the leader's drafts are the step's), so it need not follow the leader's stream."""
    return torch.Generator(device=runner.device).manual_seed(index)
