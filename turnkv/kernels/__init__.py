"""What the Triton kernels of every layer share (``triton_common``: the interpreter flag and the
rounding cast). Importing this package imports nothing; ``triton_common`` imports triton, so only
the Triton kernel files import it, and they are imported lazily (a CPU machine without triton
never does)."""
