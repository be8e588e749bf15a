"""What NCCL allocates on a GPU for a communicator and its connections, from NCCL's own constants (2.28).

The double counts these bytes per fake GPU (fake_nccl.py: `FakeNccl.device_bytes`), and the communicator
benchmark (benchmarks/nccl_comm_count.py) prices each layout with them. Every number is NCCL's:

- One connection (one direction, one channel, one peer) holds a buffer per protocol (src/transport/p2p.cc,
  p2pRecvSetup: recvSize adds comm->buffSizes[p] for every protocol; with P2P read the SIMPLE one sits on the
  sender instead, the same bytes): buffSizes from src/init.cc, computeBuffSizes:
    LL     = NCCL_LL_LINES_PER_THREAD (8) x NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS (8) x 16 B (ncclLLFifoLine)
    LL128  = NCCL_LL128_ELEMS_PER_THREAD (120) x NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS (8) x 8 B
    SIMPLE = DEFAULT_BUFFSIZE, 1 << 22
  (src/include/device.h for the thread and step constants): 9,633,792 bytes, 9.19 MiB.
- A communicator's collectives: ring channels (src/init.cc, setupChannel + ncclTransportRingConnect: one
  receive connection per channel from the ring's previous rank) and, past two ranks, the tree (on one node a
  chain: ncclTransportTreeConnect adds the connection from the chain's next rank; with two ranks it is the
  ring's peer, already connected); on an NVSwitch system past two GPUs (src/transport/nvls.cc, ncclNvlsInit:
  gpuCount <= 2 has none) the NVLS buffers, ncclNvlsBufferSetup: nvlsChannels (NVLS_NCHANNELS_SM90 = 16) x 2 x
  NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS x nHeads (one head per GPU on one node: src/graph/search.cc forces
  the intra-node NVLS graph to ngpus channels). With NCCL_RUNTIME_CONNECT=0 all of them are made at
  ncclCommInitRank (src/init.cc: `comm->runtimeConn = ... ncclParamRuntimeConnect()`; else they are made at
  an algorithm's first use).
- Point to point: connections on first use of a peer (src/group.cc, ncclP2PPreconnectFunc ->
  ncclTransportP2pSetup(comm, NULL, 1)), p2pnChannelsPerPeer channels each (src/graph/paths.cc,
  ncclTopoComputeP2pChannels: NVLink peers 2 x links, capped by the communicator's p2p channels, a power of two).
- The channel counts depend on the machine: `channels` defaults to MAXCHANNELS (32, src/include/device.h),
  what an 8-GPU NVSwitch node reaches; `p2p_channels_per_peer` to the same cap. A GPU run measures the real
  thing (benchmarks/gpu_check.py: torch.cuda.mem_get_info before and after the communicators).
"""

from __future__ import annotations

from dataclasses import dataclass

NCCL_STEPS = 8
LL_BYTES = 8 * 512 * NCCL_STEPS * 16
LL128_BYTES = 120 * 640 * NCCL_STEPS * 8
SIMPLE_BYTES = 1 << 22
CONNECTION_BYTES = LL_BYTES + LL128_BYTES + SIMPLE_BYTES  # 9,633,792
MAX_CHANNELS = 32  # src/include/device.h: MAXCHANNELS
NVLS_CHANNELS_SM90 = 16  # src/transport/nvls.cc
NVLS_CHUNK_BYTES = 128 * 1024  # src/transport/nvls.cc: NCCL_PARAM(NvlsChunkSize, "NVLS_CHUNKSIZE", 128*1024)


@dataclass(frozen=True)
class NcclMemoryModel:
    """NCCL's device bytes per rank for a communicator on one NVSwitch node (module docstring)."""

    channels: int = MAX_CHANNELS
    p2p_channels_per_peer: int = MAX_CHANNELS
    nvls: bool = True  # an NVSwitch system with multicast (H100/H200 SXM)

    def collectives(self, nranks: int) -> int:
        """Ring, tree and NVLS buffers of one rank of an `nranks` communicator (all algorithms connected)."""
        if nranks < 2:
            return 0
        ring = self.channels * CONNECTION_BYTES
        tree = self.channels * CONNECTION_BYTES if nranks > 2 else 0
        nvls = (
            NVLS_CHANNELS_SM90 * 2 * NVLS_CHUNK_BYTES * NCCL_STEPS * nranks if self.nvls and nranks > 2 else 0
        )
        return ring + tree + nvls

    def peer(self) -> int:
        """One direction of point to point with one peer (its receive side; the send side's SIMPLE buffer with
        P2P read: counted once, here)."""
        return self.p2p_channels_per_peer * CONNECTION_BYTES


MIB = 1 << 20
