"""Diagnostics: commands that run the real trainer to answer one question about a config and the
software under it (``goodput diagnose``). They reuse ``goodput.train``; none copies the loop.

``smoke``: the bit-exact smoke gate (does this stack still produce the numbers it did?), with
its record file in ``smoke_record``.
"""
