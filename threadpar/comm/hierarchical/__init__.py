"""The hierarchical backend: groups spanning processes, threads meeting locally and gloo between processes."""
