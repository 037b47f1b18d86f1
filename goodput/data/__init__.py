"""The data part: tokenize once, blend by weight, pin everything.

Modules: ``readers`` (raw inputs), ``tokenizer`` (plug-ins), ``corpus`` (embedded demo corpus),
``shards`` (Megatron ``.bin/.idx``), ``tokenize`` (the parallel, resumable job), ``manifest``
(pinning and fingerprints), ``schema`` (what each manifest must hold), ``file_list`` (the
blend's input), ``sources`` (the stages' file lists and shards as one set), ``interleave`` (the
weight-honouring order), ``stages`` (data-mix stages: schedule, staged interleave), ``blend``
(indices), ``mixture`` (the mixture report, per corpus and per stage), ``index_files`` (the
index arrays: saved, read, hashed), ``loader`` (per-rank batches) and ``paths`` (user-given
names and destinations, file identity). Nothing here imports
``goodput.train``.
"""
