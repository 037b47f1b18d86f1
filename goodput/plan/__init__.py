"""Planning a run from its config and its machine alone: the parallel layout a model needs
(``goodput plan layout``) and the failure budget of the job (``goodput plan reliability``).

Torch-free, so it runs on a login node, and it allocates nothing: ``layout`` (the degrees and
what goodput's trainer accepts), ``memory`` (the per-device memory model), ``cost`` (the
seconds of a step, which ranks the layouts that fit), ``batch`` (the global batch split and
the critical batch estimate), ``ladder`` (the candidates, in order of pain, and the choice) and
``report`` (text and JSON); ``reliability`` is the failure budget (``goodput plan
reliability``). Whether goodput's trainer takes a layout is asked of its own
torch-free rules (``goodput.train.config.parallel``). A test imports every module in a fresh
interpreter and finds no torch (but ``verify``, which imports it in its child processes only);
the config tables are read by the command (``goodput.commands.plan``).
"""
