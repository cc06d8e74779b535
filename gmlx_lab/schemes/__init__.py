"""The built-in schemes, one module each: fp16 (the baseline), affine and affine_rot,
kvarn, and the field's schemes beside them: turboquant, float (mxfp4/nvfp4/mxfp8) and kivi.

Importing this package registers them (gmlx_lab's __init__ does), in this order, which is the order error
messages and the widgets list them in; a plug-in is one more module like these that calls
`gmlx_lab.register_scheme`.
"""

from importlib import import_module

BUILT_IN = ("fp16", "affine", "kvarn", "turboquant", "floatq", "kivi")

for _name in BUILT_IN:
    import_module(f"{__name__}.{_name}")
