"""``goodput chaos``: a campaign that trains a config straight and again with faults injected
(the hooks are ``goodput.faults``), then checks that recovery lost nothing.

``plan`` draws the faults from a seed, ``campaign`` runs both runs under the launcher,
``records`` reads back what the hooks fired, ``outcomes`` prices each fault on the report's
timeline, ``compare`` holds the faulted run's losses and final state to the straight one's bit for
bit, and ``report`` is the campaign's tables and JSON.
"""
