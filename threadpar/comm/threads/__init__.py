"""The `threads` backend: collectives over shared memory between the rank threads of one process."""
