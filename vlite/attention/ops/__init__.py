"""Triton kernels of the GPU attention backend, one module per kernel family.

Importing them needs `triton` (the `gpu` extra; the `test` extra runs them on the CPU under
TRITON_INTERPRET=1, which must be set before these modules are imported).
"""
