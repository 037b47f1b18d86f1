"""The data part: tokenize once, blend by weight, pin everything.

Modules: ``readers`` (raw inputs), ``tokenizer`` (plug-ins), ``shards`` (Megatron
``.bin/.idx``), ``tokenize`` (the parallel, resumable job), ``manifest`` (pinning and
fingerprints), ``schema`` (what each manifest must hold), ``inspect`` (``goodput data
inspect``: a shard or dataset against its manifest), ``file_list`` (the blend's input),
``sources`` (the stages' file lists and shards as one set), ``interleave`` (the
weight-honouring order, with its C kernel ``_interleave.c``), ``stages`` (data-mix stages:
schedule, staged interleave), ``blend`` (indices), ``prefix`` (the digest of a blend's first n
samples, which lets a resumed run be longer), ``mixture`` (the mixture report, per corpus and
per stage), ``index_files`` (the index arrays: saved, read, hashed), ``loader`` (per-rank
batches) and ``paths`` (user-given names and destinations, file identity). For the demo only:
``demo_corpus`` (the embedded corpus, ``goodput data demo-corpus``) and ``demo_tasks/`` (its
multiple-choice task). Nothing here imports ``goodput.train`` or ``goodput.launch``.
"""
