"""``goodput report``: where a run's hours went, from its run directory alone (torch-free).

``run_files`` reads the run directory (the report's only input), ``accounting`` computes goodput
and badput by cause (the one definition chaos and the benchmarks call too), and the views show it:
``terminal`` (``rich`` tables), ``html`` (one self-contained page) with ``plots`` (its figures).
``compare`` and ``compare_views``: runs side by side at matched tokens (``goodput report A B``).
``sums``: sums and means over run-file values that no finite value makes overflow.
"""
