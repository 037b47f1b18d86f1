"""The orchestration part: where ranks run and how they are placed.

Runs on login nodes and inside watchdogs, so nothing in this package imports torch at module
level (a test checks it in a fresh interpreter); ``device`` imports it inside its functions.
"""
