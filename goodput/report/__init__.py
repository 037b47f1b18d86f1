"""goodput report: where a run's hours went, from its run directory alone."""
