"""The step-plan channel over the network: rank 0 broadcasts each message to ranks on any host.

A :class:`NetPlanChannel` is a :class:`~xllm.core.executor.channel.StepChannel` built on
``torch.distributed``: a process group of its own (gloo, made with ``dist.new_group`` over the ranks of
the instance's default group), whose timeout is the longest an idle instance's workers wait for the
next plan (``idle_timeout_s``), apart from the collectives' group and its short timeout. A message is
two broadcasts from rank 0: an int64 header ``[kind, nbytes]``, then (``nbytes`` > 0) the payload bytes.

Rank 0 posts both asynchronously (a gloo broadcast's root completes only once every reader posted its
receive, which a worker still loading its shard has not): :meth:`~NetPlanChannel.publish` returns at
once, after the previous message was taken (bounded by its ``timeout_s``); ``SHUTDOWN`` is awaited.
A reader waits in short polls, checking ``alive()`` between them; a dropped connection to rank 0
(its process died: the peer closed it) fails the wait at once, as :class:`RankFailed`.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xllm.core.executor.channel import SHUTDOWN, RankFailed

_POLL_S = 0.5  # how often a waiting side checks liveness (a completion wakes it at once)


@dataclass(frozen=True)
class NetChannelSpec:
    """A network channel of ``size`` ranks: messages of at most ``slot_bytes`` (the same bound as the
    shared-memory channel's slots, so rank 0 splits what does not fit the same way); ``idle_timeout_s``:
    the channel group's timeout, the longest a reader waits for a message (an idle instance)."""

    size: int
    slot_bytes: int
    idle_timeout_s: float


class NetPlanChannel:
    """One rank's side of the channel (see the module docstring); :meth:`join` on every rank."""

    def __init__(self, spec: NetChannelSpec, rank: int, group: Any) -> None:
        import torch.distributed as dist

        self.spec = spec
        self.rank = rank
        self.seq = 0  # the last sequence written (rank 0) or read (a reader)
        self._dist = dist
        self._group = group
        self._pending: list[Any] = []  # rank 0: the last message's broadcasts
        self._sending: list[torch.Tensor] = []  # ... and their tensors (alive until sent)
        self._pending_seq = 0

    @classmethod
    def join(cls, spec: NetChannelSpec) -> NetPlanChannel:
        """This process's side, as its rank in ``torch.distributed``'s default group (every rank of the group
        calls it: making the channel's group is collective). ``ValueError`` without a default group of
        ``spec.size`` ranks."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != spec.size:
            raise ValueError(f"a network plan channel of {spec.size} ranks needs a torch.distributed group of "
                             f"{spec.size} ranks (xllm.core.parallel.comm.GlooComm) joined first")
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=spec.idle_timeout_s))
        return cls(spec, dist.get_rank(), group)

    # ---- rank 0 --------------------------------------------------------------------
    def publish(self, kind: int, payload: bytes | np.ndarray, timeout_s: float,
                check: Callable[[], None] | None = None) -> int:
        """Send one message to every reader; its sequence number. Waits (at most ``timeout_s``, calling
        ``check`` between polls) for the previous message to be taken, else :class:`RankFailed`; waits for a
        ``SHUTDOWN`` itself too. ``ValueError`` if it exceeds ``spec.slot_bytes``."""
        if self.rank != 0:
            raise ValueError(f"rank {self.rank} cannot publish: rank 0 writes the plan channel")
        data = bytes(payload) if isinstance(payload, bytes | bytearray) else \
            np.ascontiguousarray(payload).reshape(-1).view(np.uint8).tobytes()
        if len(data) > self.spec.slot_bytes:
            raise ValueError(f"a {len(data)}-byte step plan exceeds the plan channel's {self.spec.slot_bytes}-byte "
                             "messages")
        self._settle(timeout_s, check)
        header = torch.tensor([kind, len(data)], dtype=torch.int64)
        sent = [header]
        works = [self._broadcast(header)]
        if data:
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            sent.append(body)
            works.append(self._broadcast(body))
        self.seq += 1
        self._pending, self._sending, self._pending_seq = works, sent, self.seq
        if kind == SHUTDOWN:
            self._settle(timeout_s, check)
        return self.seq

    def wait_acked(self, seq: int, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Return once every reader took message ``seq`` (every earlier one was taken before it was sent);
        :class:`RankFailed` after ``timeout_s`` or when a reader's connection dropped."""
        if seq > self.seq:
            raise ValueError(f"message {seq} was not sent (the last is {self.seq})")
        if seq == self._pending_seq:
            self._settle(timeout_s, check)

    def _broadcast(self, t: torch.Tensor) -> Any:
        try:
            return self._dist.broadcast(t, 0, group=self._group, async_op=True)
        except Exception as e:  # the group is gone (closed, or a peer failed before)
            raise RankFailed(f"rank {self.rank}: the plan channel failed: {e}") from e

    def _settle(self, timeout_s: float, check: Callable[[], None] | None) -> None:
        """Wait for the last message's broadcasts (see :meth:`publish`)."""
        deadline = time.monotonic() + timeout_s
        for work in self._pending:
            while not _wait(work, min(_POLL_S, timeout_s)):
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    raise RankFailed(f"a rank took no step plan (message {self._pending_seq}) for {timeout_s:.0f} s")
        self._pending, self._sending = [], []

    # ---- a reader ----------------------------------------------------------------------
    def receive(self, alive: Callable[[], bool], poll_s: float = _POLL_S) -> tuple[int, bytes]:
        """The next message ``(kind, payload)``; checks ``alive()`` every ``poll_s`` while it waits
        (:class:`RankFailed` once it is False, or once rank 0's connection dropped)."""
        header = torch.zeros(2, dtype=torch.int64)
        self._take(header, alive, poll_s)
        kind, n = int(header[0]), int(header[1])
        payload = b""
        if n:
            body = torch.empty(n, dtype=torch.uint8)
            self._take(body, alive, poll_s)
            payload = body.numpy().tobytes()
        self.seq += 1
        return kind, payload

    def _take(self, t: torch.Tensor, alive: Callable[[], bool], poll_s: float) -> None:
        work = self._broadcast(t)
        while not _wait(work, poll_s):
            if not alive():
                raise RankFailed(f"rank {self.rank}: the process that started it is gone")

    def close(self) -> None:
        """Leave the channel's group (idempotent; nothing to do once the default group was destroyed)."""
        group, self._group = self._group, None
        self._pending, self._sending = [], []
        if group is not None and self._dist.is_initialized():
            with contextlib.suppress(Exception):  # already torn down with its peers
                self._dist.destroy_process_group(group)


def _wait(work: Any, timeout_s: float) -> bool:
    """Whether ``work`` completed within ``timeout_s``; :class:`RankFailed` if it failed (a peer's
    connection dropped, the channel group's own timeout passed)."""
    try:
        work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
        return True
    except RuntimeError as e:
        if not work.is_completed():
            return False  # the poll's time ran out: still pending
        try:  # it completed between the poll's timeout and the check: ok, or its own error
            work.wait()
            return True
        except RuntimeError as failed:
            raise RankFailed(f"the plan channel's connection failed: {failed}") from e
