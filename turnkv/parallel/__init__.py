"""Tensor parallelism: one model across several GPUs (one process each), KV segments sharded by head.

- ``shard.py``: how the weights are cut (heads, MLP rows, vocabulary) -- no communication;
- ``group.py``: the process group, the collectives ``LlamaModel`` calls, the group's health;
- ``control.py``: rank 0 sends every rank the inputs of each step (replicated control);
- ``launch.py``: ``--tensor-parallel N`` on the command line (spawned ranks or torchrun);
- ``spmd.py``: one function on every rank of a fresh group, each computing alike (benches, tests).

docs/PARALLEL.md describes the process model and what was measured.
"""
