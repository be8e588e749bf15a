"""`Processes`: one launch's link to the other processes of a multi-process job.

Each process runs its own `launch` with its share of the rank threads; this object holds what they share
through torch.distributed's store, under a prefix of their own (the n-th launch of every process):

- a handshake at the start: every process must launch the same layout, backend and seed;
- failure news: the first process whose rank fails writes it under one key (first writer wins, so every
  process reports the same root cause); a watcher thread in each process polls that key and stops the
  local ranks, so a failure anywhere stops everything within a fraction of a second;
- questions between processes: a cross-process step that times out asks the other processes which of
  their members have arrived at the collective (`arrivals`); each watcher answers from its groups'
  rendezvous, so the timeout names the ranks that did not come, in whichever process they are;
- lost processes: each process records its host and pid; when a connection breaks, a peer on this host
  whose process is gone is named, with its ranks, as the root cause (`vanished`);
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
import os
import socket
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
# How long a timed-out collective waits for the other processes to say which of their ranks arrived.
ASK_TIMEOUT_S = 2.0
# How long the end of a launch waits for the failure watcher's last store call (a loaded machine can take
# seconds); one still blocked after it is in a call to a frozen store host.
WATCHER_END_S = 10.0
# After a broken connection, how long to look for the peer process that is gone (its exit takes a moment
# after its sockets close).
VANISH_WAIT_S = 0.5
# Words of a failure that a lost peer causes (gloo's and the store's errors, the router's).
DISCONNECTED = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
    "lost the connection", "lost the torch.distributed store", "did that process die", "is gone",
)  # fmt: skip


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


def process_alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs: a zombie (killed, not yet reaped) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def disconnected(text: str) -> bool:
    """Whether an error's text says a connection to another process broke."""
    lowered = text.lower()
    return any(words in lowered for words in DISCONNECTED)


class _SharedClient:
    """One store client, made while the store is up, for the short calls of the failure path (publish,
    questions, the end): cloning a client connects anew, and a connection to a store whose host process
    is gone retries for the whole store timeout. Calls take turns (a TCPStore client is not shared
    between concurrent calls); none of them blocks waiting for a key."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)

        def call(*args: Any) -> Any:
            with self._lock:
                return method(*args)

        return call


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
        self._watch_store: Any = None  # the watcher's store client (attach)
        self._abort: AbortSignal | None = None
        self._shared: Any = None  # a _SharedClient from the handshake on
        self.peers: list[tuple[str, int]] = []  # (host, pid) of each process, from the handshake
        # group key -> the local rendezvous of a group that spans processes, to answer "who arrived?".
        self._rendezvous: dict[int, Any] = {}

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
        self._shared = _SharedClient(self.store_client())
        store = self.store_client()
        store.set(f"proc/{self.rank}", json.dumps([socket.gethostname(), os.getpid()]))
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
        self.peers = [(h, pid) for h, pid in (json.loads(store.get(f"proc/{q}")) for q in range(self.count))]

    def attach(self, abort: AbortSignal, device_of: Callable[[int], torch.device]) -> None:
        """Start the failure watcher and the message router (a gloo group over every process)."""
        self._abort = abort
        pg = self._dist.ProcessGroupGloo(
            self._dist.PrefixStore("p2p", self.store_client()), self.rank, self.count, P2P_TIMEOUT
        )
        self._groups.append(pg)
        self.router = MessageRouter(pg, self.rank, self.count, device_of, self.lost)
        self.router.start()
        self._watch_store = self.store_client()  # an attribute: never destroyed on the watcher
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

    # questions ----------------------------------------------------------------------------------------------
    def register_group(self, key: int, rendezvous: Any) -> None:
        """Answer other processes' questions about group `key` from `rendezvous` (its local members)."""
        with self._lock:
            self._rendezvous[key] = rendezvous

    def arrivals(self, key: int, seq: int, procs: list[int]) -> dict[int, list[int] | None]:
        """Ask processes `procs` which of their members of group `key` have arrived at its collective
        `seq`: process -> their global ranks, or None where no answer came within ASK_TIMEOUT_S (a process
        that is gone or frozen). Raises RankAborted if the launch stops meanwhile."""
        answers: dict[int, list[int] | None] = {q: None for q in procs}
        try:
            store = self._shared
            where = {}
            for q in procs:
                n = store.add(f"asks/{q}", 1)
                store.set(f"ask/{q}/{n}", json.dumps([key, seq]))
                where[q] = f"answer/{q}/{n}"
            deadline = time.monotonic() + ASK_TIMEOUT_S
            while any(answers[q] is None for q in procs) and time.monotonic() < deadline:
                for q in procs:
                    if answers[q] is None and store.check([where[q]]):
                        answers[q] = json.loads(store.get(where[q]))
                if self._abort is not None:
                    self._abort.raise_if_set()
                time.sleep(0.02)
        except RankAborted:
            raise
        except Exception:  # the store is gone: say what we know
            pass
        return answers

    def _answer(self, store: Any, asked: int) -> int:
        """Answer the questions to this process from number `asked` on; returns the next one's number."""
        while store.check([f"ask/{self.rank}/{asked}"]):
            key, seq = json.loads(store.get(f"ask/{self.rank}/{asked}"))
            with self._lock:
                rendezvous = self._rendezvous.get(key)
            arrived = [] if rendezvous is None else rendezvous.arrived(seq)  # no group here: nobody came
            store.set(f"answer/{self.rank}/{asked}", json.dumps(arrived))
            asked += 1
        return asked

    # lost processes -------------------------------------------------------------------------------------------
    def ranks_of(self, process: int) -> list[int]:
        start = process * self.threads_per_process
        return list(range(start, start + self.threads_per_process))

    def vanished(self, wait: float = 0.0) -> list[int]:
        """The other processes on this host that are gone (their pid exited or was killed), looking for up
        to `wait` seconds. Processes on other hosts cannot be checked from here and are never named."""
        host = socket.gethostname()
        deadline = time.monotonic() + wait
        while True:
            gone = [
                q
                for q, (h, pid) in enumerate(self.peers)
                if q != self.rank and h == host and not process_alive(pid)
            ]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.02)

    def _lost_failure(self, reason: str, wait: float) -> Failure:
        """The failure to report for a broken connection: the vanished process, if one is found."""
        gone = self.vanished(wait)
        if not gone:
            return Failure(self.rank, -1, "ProcessLost", reason)
        named = "; ".join(
            f"process {q} (ranks {self.ranks_of(q)}, pid {self.peers[q][1]}) is gone" for q in gone
        )
        return Failure(
            gone[0],
            -1,
            "ProcessLost",
            f"{named}: it exited or was killed (kill -9, the out-of-memory killer) while the others ran; "
            f"process {self.rank} noticed: {reason}",
        )

    # failures ---------------------------------------------------------------------------------------------------
    def publish(self, failure: Failure) -> None:
        """Tell every process about a failure here; whoever wrote first is the root cause everywhere."""
        try:
            stored = self._shared.compare_set("abort", "", failure.encode())
            winner = Failure.decode(stored)
        except Exception:  # the store is gone too: report what we know
            winner = failure
        with self._lock:
            if self.failure is None:
                self.failure = winner

    def publish_rank_failure(self, rank: int, error: BaseException, traceback_text: str) -> None:
        text = str(error)
        if disconnected(text) and self.vanished(VANISH_WAIT_S):  # the cause is the process that is gone
            self.publish(self._lost_failure(f"rank {rank} failed with {type(error).__name__}: {text}", 0.0))
            return
        self.publish(Failure(self.rank, rank, type(error).__name__, text, traceback_text))

    def lost(self, reason: str) -> None:
        """A process-level problem (a peer vanished, the store is gone): stop everything."""
        if self._stop.is_set():
            return
        self.publish(self._lost_failure(reason, VANISH_WAIT_S if disconnected(reason) else 0.0))
        if self._abort is not None:
            self._abort.trigger(reason)

    def signalled(self, name: str) -> None:
        """This process got a signal (SIGTERM, SIGINT): stop every process, naming it as the cause."""
        reason = f"process {self.rank} (ranks {self.ranks_of(self.rank)}) received {name}"
        if not self._stop.is_set():
            # torchrun sends SIGTERM when a worker died: then the dead one is the cause to report
            lost = self._lost_failure(reason, 0.0)
            self.publish(lost if lost.process != self.rank else Failure(self.rank, -1, name, reason))
        if self._abort is not None:
            self._abort.trigger(reason)

    def _watch(self) -> None:
        """Answer questions, and stop the local ranks on a failure elsewhere; questions are answered until
        the end of the launch (a process that stopped may still be asked who arrived)."""
        store, errors, asked, stopped = self._watch_store, 0, 1, False
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                asked = self._answer(store, asked)
                if stopped or not store.check(["abort"]):
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
            stopped = True

    # end --------------------------------------------------------------------------------------------------------
    def finish(self, failed: bool) -> bool:
        """Meet the other processes at the end of the launch and tear down; returns whether it failed."""
        try:
            if not failed:
                assert self.router is not None and self._abort is not None, "finish() before attach()"
                self.router.close(self._abort, self.timeout)
            store = self._shared
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
            self._join_watcher()
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

    def _join_watcher(self) -> None:
        """Wait for the watcher to end: it is at most in one store call, short unless the store's host
        froze (then it ends at the store's timeout, minutes). Its end drops its store client and its hold
        on this object, which must not happen during interpreter exit (runtime/launch.py: _join_left), so
        a watcher still running after WATCHER_END_S keeps them alive for good."""
        if self._watcher is None:
            return
        self._watcher.join(WATCHER_END_S)
        if self._watcher.is_alive():
            _leak(self)
        self._watcher = None

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
