"""Autograd's device threads, turned off on a rank thread whose GPU other ranks of the process share.

torch's autograd engine keeps one ready queue and one worker thread per CUDA device for the whole process,
shared by every backward (torch/csrc/autograd/engine.cpp: Engine::start_device_threads starts them;
Engine::ready_queue returns `device_ready_queues_.at(device.index())` for a CUDA node, whatever graph task it
belongs to). Ranks on one GPU would run their backwards on that one thread: a collective inside one rank's
backward (DDP's bucket all-reduce, a TP layer's) blocks it in the rendezvous while the other ranks' backward
work waits behind it in the same queue, a hang (issue 14, defect 4; tests/test_shared_device_thread.py).

With multithreading disabled, Engine::ready_queue returns the graph task's CPU ready queue for every node
(`if (multithreading_disabled || should_run_in_cpu_ready_queue(device.type())) return cpu_ready_queue;`), and
Engine::execute_with_graph_task drives that queue on the thread that called backward (`thread_main(graph_task)`):
each rank's backward runs on its own rank thread, with its device current (RankContext.enter). The flag is
thread-local (`c10::AutogradState::get_tls_state()`: c10/core/AutogradState.cpp keeps a `thread_local
AutogradState`; torch.autograd.set_multithreading_enabled sets it for the calling thread only), so turning it
off here changes no other thread (DESIGN.md rule 1). With torch_distributed on, the rank's session turns it off
as well (torch_dist/session.py); this covers torch_distributed=False, where nothing else would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from threadpar.comm.common.gpu import is_gpu


def shares_gpu(devices: Sequence[torch.device], local_ranks: Sequence[int], rank: int) -> bool:
    """Whether `rank`'s CUDA device is also the device of another rank of this process."""
    mine = devices[rank]
    return is_gpu(mine) and sum(1 for r in local_ranks if devices[r] == mine) > 1


@contextlib.contextmanager
def backward_on_this_thread(enabled: bool) -> Iterator[None]:
    """While open (when `enabled`), backward calls made by this thread run on it, not on a device thread."""
    if not enabled:
        yield
        return
    saved = torch._C._is_multithreading_enabled()
    torch._C._set_multithreading_enabled(False)
    try:
        yield
    finally:
        torch._C._set_multithreading_enabled(saved)
