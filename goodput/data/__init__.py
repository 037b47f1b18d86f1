"""The data part: tokenize once, blend by weight, pin everything.

Modules: ``readers`` (raw inputs), ``tokenizer`` (plug-ins), ``corpus`` (embedded demo corpus),
``shards`` (Megatron ``.bin/.idx``), ``tokenize`` (the parallel, resumable job), ``manifest``
(pinning and fingerprints), ``schema`` (what each manifest must hold), ``file_list`` (the
blend's input), ``interleave`` (the weight-honouring order), ``blend`` (indices and the mixture
report), ``index_files`` (the index arrays: saved, read, hashed), ``loader`` (per-rank batches)
and ``paths`` (user-given names and destinations, file identity). Nothing here imports
``goodput.train``.
"""
