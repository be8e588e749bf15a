"""Point-to-point messages between the member threads of a group: buffered mailboxes.

`put` never blocks (the message is the sender's own copy), so two ranks that send to each other at the
same time cannot deadlock. Messages from one source with one tag arrive in the order they were sent.
A message carries its tensor, so shape and dtype travel with it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from threadpar.comm.common.abort import AbortSignal, wait_until

# What a backend posts: the tensor (threads), or the tensor and what orders its copy on the device (CUDA).
Message = Any


class Mailboxes:
    def __init__(self, name: str, ranks: Sequence[int], abort: AbortSignal, timeout: float) -> None:
        self.name = name
        self.ranks = tuple(ranks)
        self._abort = abort
        self._timeout = timeout
        # One condition per receiver: a send wakes only the thread it is addressed to.
        self._conds = [threading.Condition(threading.Lock()) for _ in self.ranks]
        for cond in self._conds:
            abort.register(cond)
        self._queues: list[dict[tuple[int, int], deque[Message]]] = [{} for _ in self.ranks]

    def put(self, src: int, dst: int, tag: int, message: Message) -> None:
        with self._conds[dst]:
            self._queues[dst].setdefault((src, tag), deque()).append(message)
            self._conds[dst].notify_all()

    def _find(self, dst: int, src: int | None, tag: int) -> tuple[int, int] | None:
        queues = self._queues[dst]
        if src is not None:
            return (src, tag) if queues.get((src, tag)) else None
        return next((key for key, q in queues.items() if key[1] == tag and q), None)

    def has_message(self, dst: int, src: int | None, tag: int) -> bool:
        with self._conds[dst]:
            return self._find(dst, src, tag) is not None

    def take(self, dst: int, src: int | None, tag: int, timeout: float | None = None) -> tuple[int, Message]:
        """Block until a message from `src` (any source if None) with `tag` arrives; return (src, message)."""
        timeout = self._timeout if timeout is None else timeout
        cond = self._conds[dst]
        with cond:
            wait_until(
                cond,
                lambda: self._find(dst, src, tag) is not None,
                abort=self._abort,
                deadline=time.monotonic() + timeout,
                describe_timeout=lambda: self._describe_timeout(dst, src, tag, timeout),
            )
            key = self._find(dst, src, tag)
            assert key is not None  # wait_until returned: a message is there
            message = self._queues[dst][key].popleft()
        return key[0], message

    def _describe_timeout(self, dst: int, src: int | None, tag: int, timeout: float) -> str:
        source = "any rank" if src is None else f"rank {self.ranks[src]}"
        pending = sorted((self.ranks[s], t) for (s, t), q in self._queues[dst].items() if q)
        return (
            f"recv on rank {self.ranks[dst]} from {source} (tag {tag}, group '{self.name}') timed out after "
            f"{timeout:g} s: no matching message arrived (messages waiting from (rank, tag): {pending or 'none'}). "
            "Check that the sender calls send() with this rank as dst and the same tag."
        )
