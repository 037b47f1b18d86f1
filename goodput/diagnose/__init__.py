"""``goodput diagnose``: questions about a config, the software under it or a finished run,
answered by running the real trainer or reading its run files. It reuses ``goodput.train``;
none of it copies the loop.

- ``smoke``: the bit-exact smoke gate (does this stack still produce the numbers it did?), with
  its record file in ``smoke_record``.
- ``lr_find``: the LR range test on a fresh model; ``lr_regions`` is its torch-free curve
  arithmetic and ``plots`` its figure.
- ``batch_size``: a run's gradient noise scale against its global batch (reads the run
  directory only).

The in-loop diagnostics (``[diagnostics]``) are the trainer's: ``goodput.train.monitor``.
"""
