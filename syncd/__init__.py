"""syncd: keeps Burn (.bpk) and PyTorch (.safetensors) checkpoints interchangeable."""

__version__ = "0.1.0"
