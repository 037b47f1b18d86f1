"""Evaluation: multiple-choice tasks read from local files (``choice_tasks``) and scored by the
log-likelihood a model gives each choice (``harness``); text generation from a checkpoint with a
KV cache (``generate``, behind ``goodput generate``); EleutherAI lm-eval's evaluator on a
checkpoint, scored as the harness scores (``lm_eval_model``, ``lm_eval_tasks``, behind ``goodput
eval``)."""
