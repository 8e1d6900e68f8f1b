"""Kernels graphopt rewrites into (Lightning Attention, MoE permute/grouped GEMM, comm).

Empty until the kernel capabilities land; nothing here is registered or imported by passes.
"""
