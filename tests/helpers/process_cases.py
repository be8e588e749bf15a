"""Test cases written for torch's process-per-rank harness, run on rank threads by tests/test_process_tests.py."""

from __future__ import annotations

import os
import signal
import sys
import time
import unittest
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    MultiProcessTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms

PROBE: dict[str, object] = {}  # what the ranks saw, for the checks in tests/test_process_tests.py


class TwoRanks(MultiProcessTestCase):
    """torch's own pattern: setUp spawns, each rank initialises gloo through a file store."""

    def setUp(self) -> None:
        super().setUp()
        if self._testMethodName == "test_killed_by_a_signal":  # as torch's NCCL watchdog tests declare it
            self.special_return_code_checks[self.test_killed_by_a_signal.__wrapped__] = -signal.SIGABRT
        self._spawn_processes()

    @property
    def world_size(self) -> int:
        return 2

    def _init(self) -> None:
        dist.init_process_group(
            "gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=self.world_size
        )

    def test_all_reduce_and_rank_state(self) -> None:
        self._init()
        t = torch.full((3,), float(self.rank + 1))
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((3,), 3.0))
        # set_rng_seed() seeded every rank alike, as in a fresh process each: the same draws on both ranks.
        draws = [torch.zeros(4) for _ in range(2)]
        dist.all_gather(draws, torch.rand(4))
        self.assertEqual(draws[0], draws[1])
        with self.assertWarnsRegex(UserWarning, "per rank"):  # every rank records its own warning
            warnings.warn(f"per rank {self.rank}", stacklevel=1)
        PROBE[f"file {self.rank}"] = self.file_name
        PROBE[f"class {self.rank}"] = type(self)

    def test_fails_on_rank_1(self) -> None:
        self._init()
        if self.rank == 1:
            raise ValueError("boom on rank 1")
        dist.barrier()  # rank 0 waits here for rank 1, which failed: stopped, not hung

    @unittest.expectedFailure
    def test_expected_failure(self) -> None:
        self.assertEqual(self.rank, 7)

    @skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self) -> None:
        raise AssertionError("skipped on a machine without 2 GPUs")

    def test_exit_code_skip(self) -> None:
        sys.exit(73)  # torch's TEST_SKIPS["small_worldsize"]

    def test_hangs_on_rank_1(self) -> None:
        self._init()
        if self.rank == 1:
            while True:  # busy in Python: stopped by the timeout's abort
                time.sleep(0.01)
        dist.barrier()

    def test_killed_by_a_signal(self) -> None:
        raise AssertionError("never run: it expects its process to die of SIGABRT")


class ContinuousRanks(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    def test_a_fails(self) -> None:
        raise RuntimeError(f"failing on rank {self.rank}")

    def test_b_group_per_rank(self) -> None:
        # What _init_pg stored on the class (cls.pg, cls.rank) is this rank's: a subclass per rank.
        self.assertIs(self.pg, dist.distributed_c10d._get_default_group())
        self.assertEqual((type(self).rank, dist.get_rank()), (self.rank, self.rank))
        t = torch.ones(2) * self.rank
        dist.all_reduce(t)
        self.assertEqual(t, torch.ones(2))
        PROBE[f"continuous {self.rank}"] = os.environ["LOCAL_RANK"]


class DTensorCase(DTensorTestBase):
    @with_comms
    def test_distribute_and_gather(self) -> None:
        mesh = self.build_device_mesh()
        torch.manual_seed(5)  # every rank seeds alike and draws the same tensor, as processes do
        full = torch.randn(8, 3)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.full_tensor(), full)
        self.assertEqual(sharded.to_local(), full.chunk(self.world_size)[self.rank])
