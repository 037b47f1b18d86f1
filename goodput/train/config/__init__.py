"""The run config's tables, torch-free, read by ``goodput train``, ``goodput plan`` and ``submit``.

``run.py`` (the run config, its ``[train]`` ``[data]`` ``[checkpoint]`` ``[diagnostics]``
``[watch]`` tables and the batch plan), ``model.py`` (``[model]``), ``parallel.py``
(``[parallel]`` and the rules a layout must meet), ``optim.py`` (``[optim]``), ``schedule.py``
(``[schedule]`` and the learning rate as a pure function of the step), ``metrics.py``
(``[metrics]``), ``profile.py`` (``[profile]``, torch.profiler's table), ``precision.py`` (the
precision policies: dtype names and bytes, for the trainer, the planner and the FLOP count). No
module here imports torch.
"""
