"""kvarn: Hadamard rotation and variance-normalized 128-token records with an fp16 sink and tail.

`records.py` is the record format (what the kernels read too); `cache.py` the cache and its registry entry. This
file imports neither, so the kernels can read the format without the cache.
"""
