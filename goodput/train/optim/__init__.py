"""The optimizers, keyed by ``[optim] kind`` (``optimizers.KINDS``): AdamW, LAMB, SophiaG, Muon
and Mano, each one rule in its own module, with the QK-clip (``qk_clip.py``) and the learning
rate's scaling and per-group labels (``lr_scale.py``) they share with the loop."""
