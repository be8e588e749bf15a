"""The `nccl` backend: one NCCL communicator per group through torch.cuda.nccl, and its process-spanning form."""
