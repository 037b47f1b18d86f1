"""The training part. ``setup`` is the portable start of every run."""
