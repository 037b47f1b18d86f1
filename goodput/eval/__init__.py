"""Evaluation: multiple-choice tasks read from local files (``choice_tasks``) and scored by the
log-likelihood a model gives each choice (``harness``)."""
