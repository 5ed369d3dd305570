"""What names and marks a PyTorch `torch.save` checkpoint, apart from its reader (pytorch.py).

The registry describes every format at import; the PyTorch reader itself (a pickle interpreter, a zip
directory reader) is imported only when such a file is read: a conversion between the other two formats does
not pay for it (8 ms of every `syncd convert`'s start-up).
"""

from __future__ import annotations

NAME = "pytorch"  # described in registry.py
# .ckpt: PyTorch Lightning's (and Stable Diffusion's) torch.save files; .tar: `checkpoint.pth.tar`, the name
# timm's and torchvision's training scripts save under (a torch.save zip whatever its name says)
EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".tar")
# a double extension that names one checkpoint: its conversion is `model_best.bpk`, not `model_best.pth.bpk`
DOUBLE_EXTENSIONS = (".pth.tar", ".pt.tar")
ZIP_MAGIC = b"PK\x03\x04"
# The file names a watch takes as PyTorch checkpoints when asked to (a `.bin` is anything, so only these).
DAEMON_PATTERNS = ("*.pt", "*.pth", "pytorch_model*.bin", "*.ckpt", "*.pth.tar")
