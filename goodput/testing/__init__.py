"""Test helpers shipped with the package so that tests and benchmarks share them: ranks on
localhost (``dist``, ``ranks``), the tiny model and run (``tiny``, ``stages``, ``bigram``),
synthetic run directories (``run_dirs``; at the seed's scale, ``scale_runs``), a process's
/proc figures (``proc``), fixtures of each
part (``optimizers``, ``snapshots``, ``eval_tasks``, ``recipes``, ``fuzz``, ``trees``,
``doc_commands``) and the machine's real
services (``jobs``, ``sshd``, ``unprivileged``, ``venvs``). Nothing in goodput's own parts
imports it."""
