"""Chaos: the campaign that injects faults into a run (the hooks are ``goodput.faults``) and
checks that recovery lost nothing."""
