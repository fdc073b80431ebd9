"""Pallas low-precision kernels (int8 / fp8 GEMM, fused quantize, Global-QSGD encode).

Kernels land with the Pallas issue; until then qsync_jax.ops runs every
precision through XLA.
"""
