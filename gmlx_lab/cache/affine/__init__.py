"""mlx-lm's grouped affine quantization, and the same after a Hadamard rotation (affine_rot): the caches and their
registry entries are `cache.py`; the fused decode kernel's launch code is `gmlx_lab/kernels/affine.py`.
"""
