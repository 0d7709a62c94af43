"""lockstep: train PyTorch models on one process, every GPU of a node, or many nodes."""

__version__ = "0.1.0"
