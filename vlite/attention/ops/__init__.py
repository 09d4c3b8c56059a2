"""Attention ops, one module per kernel family.

The Triton kernels of the GPU attention backend (triton_*) need `triton` (the `gpu` extra; the `test`
extra runs them on the CPU under TRITON_INTERPRET=1, which must be set before these modules are
imported). `cascade` is plain torch: the reference math of cascade attention (shared-prefix decode), which
`triton_cascade` (the GPU backend's cascade path) must match.
"""
