"""What the loop watches while it trains, without changing the step: the in-loop diagnostics
(``diagnostics.py``, ``[diagnostics]``: gradient noise scale, loss spikes, the bf16 freeze check)
and the straggler watch (``stragglers.py``, ``[watch]``)."""
