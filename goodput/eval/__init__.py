"""Evaluation, in the training loop and on a checkpoint.

In the loop: ``[eval]`` (``config``), the blend's held-out loss per corpus and multiple-choice
tasks scored through the training step in the run's own layout (``heldout``), the alarm for a
run whose loss falls while it learns nothing the evals measure (``gate``), and
``RUN/evals.jsonl``, one line per metric for the loop and ``goodput eval`` alike (``records``).

On a checkpoint: its model and tokenizer, whole or sharded over the ranks of a launch
(``inference``); multiple-choice tasks read from local files (``choice_tasks``) and scored by the
log-likelihood a model gives each choice (``harness``); text generation with a KV cache
(``generate``, behind ``goodput generate``); EleutherAI lm-eval's evaluator, scored as the
harness scores (``lm_eval_model``, ``lm_eval_tasks``, ``task_data``, behind ``goodput eval``).
"""
