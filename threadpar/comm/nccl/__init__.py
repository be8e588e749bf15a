"""The `nccl` backend: one NCCL communicator per member and group through NCCL's C API, and its process-spanning form."""
