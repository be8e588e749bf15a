"""A rank's whole training step as one CUDA graph (`graphed_step`): step.py."""

from threadpar.cuda_graphs.step import GraphedStep, graphed_step, graphs_here

__all__ = ["GraphedStep", "graphed_step", "graphs_here"]
