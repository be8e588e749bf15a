"""A thread's own count of torch's intra-op threads (DESIGN.md rule 4)."""

from __future__ import annotations

import torch


def set_thread_intraop_threads(n: int) -> None:
    """Give the calling thread `n` intra-op threads, kept whatever other threads set later.

    torch keeps the count per thread, and sets it from the process-wide value (the last
    torch.set_num_threads of any thread) at the thread's first parallel op (ATen/Parallel.h,
    lazy_init_num_threads; ATen/ParallelOpenMP.cpp, init_num_threads). A fresh thread that sets its count
    before that op would have it replaced there by whatever another thread set meanwhile (another launch's
    ranks, simulated processes, the caller). torch.get_num_threads() runs that first initialisation now;
    the count set after it is this thread's own.
    """
    torch.get_num_threads()
    torch.set_num_threads(n)
