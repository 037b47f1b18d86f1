"""In-memory checkpoints ("snapshots" for short; ``[checkpoint] memory_interval_steps``): every k
steps each rank's checkpoint state goes into host memory that outlives the process, with a copy
on a rank of the next host, and a restart loads the newest step every rank has before any disk
checkpoint. Not torch's memory snapshot (the allocator dump of ``[profile]
memory_snapshot_on_oom``).

- ``format``: the payload's tensor table, the chunks' digests, the manifest (parsed strictly);
- ``files``: the private host folders, the slot files' names, files read as untrusted;
- ``pairing``: which rank holds whose copy, the newest step every rank can load;
- ``wire``: what ranks send each other, and the store's collectives;
- ``slots``: this rank's slot files — mapped, committed, received into, deleted;
- ``store``: ``SnapshotStore``, taking and committing snapshots each step;
- ``restore``: choosing and restoring at a restart.
"""
