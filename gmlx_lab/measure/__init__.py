"""Measurement: what a scheme's cache costs and how far it moves the model, each against fp16.

    fidelity     teacher-forced KL(fp16 || scheme) per position, top-1 agreement, perplexity
    audit        does every layer store what its policy reports (codes, widths, fewer bytes than fp16)?
    memory       exact resident bytes per layer and region, and the prefill peak
    sizes        the byte formulas at any context, from the registry, without running the model
    tradeoff     equal-memory comparisons: fidelity against bytes per token
    experiments  beyond KL: passkey retrieval, draft acceptance, KV on quantized weights
    metrics      KL, perplexity
    passages     the evaluation passages shipped with the package, and the token windows cut from them
    intervals    95% intervals (bootstrap over passages, Wilson for counts) and `compare`, the one way to name a winner
    banded       fidelity on several passages and contexts, every number with its interval
    verdict      which scheme when: the committed banded results as recommendations by memory budget and context

They sit above the caches, the policy and the spec grammar (gmlx_lab.specs), and below the figures and
widgets. `gmlx_lab.fidelity` and `gmlx_lab.audit` are the functions; the modules live here.
"""
