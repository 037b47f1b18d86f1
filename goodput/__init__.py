"""goodput: pre-train large language models on supercomputers and keep the run alive to the end.

Three parts usable alone: ``goodput.data`` (tokenize, blend, pin), ``goodput.launch`` (one launch
command, layered recovery) and ``goodput.train`` (the trainer).
"""

__version__ = "0.1.0"
