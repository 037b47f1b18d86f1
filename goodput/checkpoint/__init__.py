"""Checkpoints: what a run saves and resumes from. Knows no model code and no scheduler.

On disk: async, bounded, atomic, reshardable saves on torch.distributed.checkpoint (DCP) by the
``Checkpointer`` (``save``), resumed at any data-parallel size (``load``), holding the run's
registered parts and every RNG (``state``) and a rank's model parts by name (``parts``); the one
safe reader of DCP's pickled ``.metadata`` (``metadata``); checksums written on save and checked
before a copy is trusted (``checksums``, ``verify``); the node-local copy each host reads
(``local_copy``); ``goodput ckpt list`` (``listing``); the ``[checkpoint]`` table (``config``).

In memory: the in-memory checkpoints (``[checkpoint] memory_interval_steps``), each rank's state
in host memory with a copy on a rank of the next host, and the restart from the newest step
every rank has: the ``snapshot`` package (its format, host folders, pairing, what the ranks
send each other, this rank's slot files, the store, the restore). Which steps save and which
take a snapshot is one rule (``schedule``).

Conversions to and from HuggingFace folders and single ``.pt`` files need the model: they are
``goodput.train.convert``'s.
"""
