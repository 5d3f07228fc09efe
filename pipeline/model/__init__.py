"""The model layer: the Transformer and its attention kernels, the losses, the KV-cache engine and
sampling, the checkpoint file format, the Hugging Face state-dict adapter, and `load_model`.
It imports nothing from the stages above it (data, training, evaluation)."""
