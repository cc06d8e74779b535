"""Measurement: what a scheme's cache costs and how far it moves the model, each against fp16.

    fidelity     teacher-forced KL(fp16 || scheme) per position, top-1 agreement, perplexity
    audit        does every layer store what its policy reports (codes, widths, fewer bytes than fp16)?
    memory       exact resident bytes per layer and region, and the prefill peak
    sizes        the byte formulas at any context, from the registry, without running the model
    tradeoff     equal-memory comparisons: fidelity against bytes per token
    experiments  beyond KL: passkey retrieval, draft acceptance, KV on quantized weights
    metrics      KL, perplexity

They sit above the caches, the policy and the spec grammar (gmlx_lab.specs), and below the figures and
widgets. Their old paths (gmlx_lab.fidelity, gmlx_lab.memory, ...) still import (gmlx_lab/__init__.py).
"""
