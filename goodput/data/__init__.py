"""The data part: tokenize once, blend by weight, pin everything.

Modules: ``readers`` (raw inputs), ``tokenizer`` (plug-ins), ``corpus`` (embedded demo corpus),
``shards`` (Megatron ``.bin/.idx``), ``tokenize`` (the parallel, resumable job), ``manifest``
(pinning and fingerprints), ``interleave`` (the weight-honouring order), ``blend`` (indices and
the mixture report) and ``loader`` (per-rank batches). Nothing here imports ``goodput.train``.
"""
