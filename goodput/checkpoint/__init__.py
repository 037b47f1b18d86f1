"""Checkpoints: async, bounded, atomic, reshardable saves on torch.distributed.checkpoint (DCP),
resume, and conversion to and from HuggingFace and single-file formats. Knows no model code."""
