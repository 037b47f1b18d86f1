"""The trainer. Its top holds the loop and what it runs, its wings the rest:

- the loop and its set-up: ``setup`` (the portable start of every run), ``build`` (the ``Run``
  the loop and lr-find share), ``resume``, ``preflight`` (what ``goodput train`` refuses before
  its first step), ``loop``, ``step`` with ``loss``, ``step_hooks`` (the per-step work around the
  step) with ``step_vote`` (the step's one vote), ``termination`` (SIGTERM as a flag),
  ``metrics`` and ``profiling``;
- the model: ``model``, ``experts`` (mixture-of-experts), ``ring_attention`` (attention under
  context parallelism), ``dtensors`` (a DTensor's local view), ``init``, ``flops`` (parameters,
  FLOPs and bytes from a config alone) and ``info`` (``goodput model info``);
- the device: ``device`` (the one module naming device types) and ``device_check`` (the child
  process of ``goodput.launch.health``);
- ``config/`` (the run config's tables, torch-free), ``optim/`` (the optimizers, QK-clip, LR
  scaling), ``monitor/`` (the in-loop diagnostics and the straggler watch), ``parallel/`` (the
  mesh and every split of the model) and ``convert/`` (HuggingFace and ``.pt`` conversions).
"""
