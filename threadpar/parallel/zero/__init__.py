"""The distributed optimizer: ZeRO-1/2 sharding of optimizer state and gradients over the DP group."""

from threadpar.parallel.zero.optimizer import ZeroRedundancyOptimizer, optimizer_state_bytes

__all__ = ["ZeroRedundancyOptimizer", "optimizer_state_bytes"]
