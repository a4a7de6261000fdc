"""Runnable examples of the Python API (`peer.api`); `examples.tiny_mlp` is the README's."""
