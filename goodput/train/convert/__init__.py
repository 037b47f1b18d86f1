"""Model-aware conversions of checkpoints: to and from single ``.pt`` files and HuggingFace Llama
folders (``checkpoints.py``), the tensor-name and RoPE map (``hf.py``), and the tokenizer written
beside an HF export (``hf_tokenizer.py``)."""
