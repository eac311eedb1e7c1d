"""Triton kernels only (``@triton.jit``); no torch.library code here. Imported lazily by the launchers."""
