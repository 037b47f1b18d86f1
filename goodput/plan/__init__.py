"""The layout planner: which parallel layout a model needs on a machine, estimated from the
config alone (``goodput plan layout``).

Torch-free, so it runs on a login node, and it allocates nothing: ``layout`` (the degrees and
what goodput's trainer accepts), ``memory`` (the per-device memory model), ``batch`` (the
global batch split and the critical batch estimate), ``ladder`` (the rungs, in order of pain)
and ``report`` (text and JSON). Whether goodput's trainer takes a layout is asked of its own
torch-free rules (``goodput.train.parallel_config``). A test imports every module in a fresh
interpreter and finds no torch; the config tables are read by the command
(``goodput.commands.plan``).
"""
