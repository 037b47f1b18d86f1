"""Chaos: injected faults (``faults``, hooked into the trainer) and the campaign that runs them."""
