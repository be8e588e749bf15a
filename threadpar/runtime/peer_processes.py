"""`Processes`: one launch's link to the other processes of a multi-process job.

Each process runs its own `launch` with its share of the rank threads; this object holds what they share
through torch.distributed's store, under a prefix of their own (the n-th launch of every process):

- a handshake at the start: every process must launch the same layout, backend and seed;
- failure news: the first process whose rank fails writes it under one key (first writer wins, so every
  process reports the same root cause); a watcher thread in each process polls that key and stops the
  local ranks, so a failure anywhere stops everything within a fraction of a second;
- gloo process groups for groups that span processes (created lazily, each through its own store client:
  a TCPStore client holds a lock through a blocking get, so clients are never shared between waits);
- the message router for point-to-point messages between processes (threadpar.comm.hierarchical.router);
- teardown: a barrier on success; on failure, gloo groups that may still hold pending operations are
  deliberately leaked, because destroying one blocks until its operations time out.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.hierarchical.router import MessageRouter
from threadpar.errors import CollectiveTimeoutError, ConfigError, RankAborted
from threadpar.runtime.process_env import ProcessEnv

WATCH_INTERVAL_S = 0.1
# A process whose rank failed first waits this long (at most) for the others to stop and report it too,
# before its own launch raises (and torchrun tears the others down).
REPORT_GRACE_S = 3.0
# The router's group waits for messages that may never come: its gloo timeout must not fire.
P2P_TIMEOUT = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class Failure:
    """What the first failing process published: enough to report it in every process."""

    process: int
    rank: int  # -1: not a rank's exception (an interrupt, a lost process)
    kind: str
    message: str
    traceback: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> Failure:
        return cls(**json.loads(raw))

    def describe(self) -> str:
        who = f"rank {self.rank} (process {self.process})" if self.rank >= 0 else f"process {self.process}"
        return f"{who} failed with {self.kind}: {self.message}"


def _clone(store: Any) -> Any:
    try:
        return store.clone()
    except (AttributeError, RuntimeError):
        return store


def _leak(obj: Any) -> None:
    """Keep `obj` alive until the process exits: a gloo group with a pending operation blocks in its
    destructor until the operation times out (minutes), which would hang the caller after a failure."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _shutdown(pg: Any) -> None:
    with contextlib.suppress(Exception):  # a torch without Backend.shutdown, or a group already down
        pg.shutdown()


class Processes:
    def __init__(self, env: ProcessEnv, threads_per_process: int, store: Any, timeout: float) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.count = env.rank, env.count
        self.threads_per_process = threads_per_process
        self.timeout = timeout
        self._base = store
        # Every process counts its own launches, so the n-th launch of each meets under one prefix.
        number = store.add(f"threadpar/launches/{self.rank}", 1)
        self.prefix = f"threadpar/launch{number}"
        self.failure: Failure | None = None  # the root cause, once known (ours or another process's)
        self.router: MessageRouter | None = None
        self._groups: list[Any] = []
        self._abandoned: list[Any] = []  # groups with an operation that may never complete
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._abort: AbortSignal | None = None

    # topology ---------------------------------------------------------------------------------------------------
    def process_of(self, global_rank: int) -> int:
        return global_rank // self.threads_per_process

    @property
    def local_ranks(self) -> range:
        start = self.rank * self.threads_per_process
        return range(start, start + self.threads_per_process)

    def store_client(self) -> Any:
        """A store client of our own under this launch's prefix (see the module note on TCPStore)."""
        return self._dist.PrefixStore(self.prefix, _clone(self._base))

    # start ------------------------------------------------------------------------------------------------------
    def handshake(self, config: dict[str, Any]) -> None:
        """Wait for every process to reach this launch, and check they all launched the same thing."""
        store = self.store_client()
        store.set(f"hello/{self.rank}", json.dumps(config, sort_keys=True))
        keys = [f"hello/{q}" for q in range(self.count)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except RuntimeError:  # DistStoreError: timed out
            missing = [q for q, key in enumerate(keys) if not store.check([key])]
            raise CollectiveTimeoutError(
                f"process {self.rank} waited {self.timeout:g} s for processes {missing} to call "
                "threadpar.launch; every process of the job must launch, with the same arguments"
            ) from None
        for q, key in enumerate(keys):
            theirs = json.loads(store.get(key))
            differ = sorted(k for k in config.keys() | theirs.keys() if config.get(k) != theirs.get(k))
            if differ:
                shown = ", ".join(f"{k}={config.get(k)!r} here but {theirs.get(k)!r} there" for k in differ)
                raise ConfigError(
                    f"process {q} launched differently from process {self.rank}: {shown}; every process "
                    "must call threadpar.launch with the same layout, threads_per_process, backend and seed"
                )

    def attach(self, abort: AbortSignal, device_of: Callable[[int], torch.device]) -> None:
        """Start the failure watcher and the message router (a gloo group over every process)."""
        self._abort = abort
        pg = self._dist.ProcessGroupGloo(
            self._dist.PrefixStore("p2p", self.store_client()), self.rank, self.count, P2P_TIMEOUT
        )
        self._groups.append(pg)
        self.router = MessageRouter(pg, self.rank, self.count, device_of, self.lost)
        self.router.start()
        self._watcher = threading.Thread(
            target=self._watch, name=f"threadpar-watch-p{self.rank}", daemon=True
        )
        self._watcher.start()

    def gloo_group(self, name: str, procs: tuple[int, ...], timeout: float | None = None) -> Any:
        """A new gloo process group over processes `procs` (sorted), met under `name` (the same in each)."""
        timeout = self.timeout if timeout is None else timeout
        # Longer than threadpar's own deadline, so ours fires first, with a message that names the call.
        gloo_timeout = datetime.timedelta(seconds=timeout * 1.1 + 5)
        store = self._dist.PrefixStore(f"pg/{name}", self.store_client())
        pg = self._dist.ProcessGroupGloo(store, procs.index(self.rank), len(procs), gloo_timeout)
        with self._lock:
            self._groups.append(pg)
        return pg

    def abandon(self, groups: list[Any]) -> None:
        """Never destroy these gloo groups (an operation on them was given up, e.g. after a mismatch)."""
        with self._lock:
            self._abandoned += groups

    # failures ---------------------------------------------------------------------------------------------------
    def publish(self, failure: Failure) -> None:
        """Tell every process about a failure here; whoever wrote first is the root cause everywhere."""
        try:
            stored = self.store_client().compare_set("abort", "", failure.encode())
            winner = Failure.decode(stored)
        except Exception:  # the store is gone too: report what we know
            winner = failure
        with self._lock:
            if self.failure is None:
                self.failure = winner

    def publish_rank_failure(self, rank: int, error: BaseException, traceback_text: str) -> None:
        self.publish(Failure(self.rank, rank, type(error).__name__, str(error), traceback_text))

    def lost(self, reason: str) -> None:
        """A process-level problem (a peer vanished, the store is gone): stop everything."""
        if self._stop.is_set():
            return
        self.publish(Failure(self.rank, -1, "ProcessLost", reason))
        if self._abort is not None:
            self._abort.trigger(reason)

    def _watch(self) -> None:
        store, errors = self.store_client(), 0
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                if not store.check(["abort"]):
                    errors = 0
                    continue
                failure = Failure.decode(store.get("abort"))
            except Exception as error:
                errors += 1
                if errors >= 3:
                    self.lost(f"process {self.rank} lost the torch.distributed store: {error}")
                    return
                continue
            with self._lock:
                if self.failure is None:
                    self.failure = failure
            assert self._abort is not None  # attach() sets it before it starts this watcher
            self._abort.trigger(failure.describe())
            return

    # end --------------------------------------------------------------------------------------------------------
    def finish(self, failed: bool) -> bool:
        """Meet the other processes at the end of the launch and tear down; returns whether it failed."""
        try:
            if not failed:
                assert self.router is not None and self._abort is not None, "finish() before attach()"
                self.router.close(self._abort, self.timeout)
            store = self.store_client()
            store.add("finished", 1)
            if not failed:
                self._wait_finished(store, self.timeout)
                failed = store.check(["abort"])  # a process that failed late also counts as finished
                if failed and self.failure is None:
                    self.failure = Failure.decode(store.get("abort"))
            elif self.failure is not None and self.failure.process == self.rank:
                self._wait_finished(store, REPORT_GRACE_S, quiet=True)
        except Exception as error:  # a stop, a timeout, or a peer that vanished at the end
            failed = True
            with self._lock:
                if self.failure is None and not isinstance(error, RankAborted):
                    self.failure = Failure(self.rank, -1, type(error).__name__, str(error))
        finally:
            self._stop.set()
            if self._watcher is not None:
                self._watcher.join(1.0)
            with self._lock:
                groups, self._groups = self._groups, []
                abandoned, self._abandoned = self._abandoned, []
            for pg in groups if failed else abandoned:
                _leak(pg)
            if not failed:
                # Stop their threads now: a group that something still references (a model keeps its
                # group handles) would otherwise be destroyed during interpreter finalization, which can
                # abort the process ("terminate called without an active exception").
                for pg in groups:
                    if not any(pg is gone for gone in abandoned):
                        _shutdown(pg)
            self.router = None
        return failed

    def _wait_finished(self, store: Any, timeout: float, quiet: bool = False) -> None:
        deadline = time.monotonic() + timeout
        while int(store.add("finished", 0)) < self.count:
            if not quiet and self._abort is not None:
                self._abort.raise_if_set()
            if time.monotonic() > deadline:
                if quiet:
                    return
                raise CollectiveTimeoutError(
                    f"process {self.rank} finished its ranks but waited {timeout:g} s for the other "
                    "processes to finish theirs"
                )
            time.sleep(0.01)
