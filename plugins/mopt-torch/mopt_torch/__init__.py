"""mopt plugin: PyTorch compile artifacts.

Target kinds: `torch-compile` (a torch.compile cache artifact; warm start with
`mopt_torch.warm`) and `aoti` (torch.export + AOTInductor package, load-checked in a child
process). Importing this package does not import torch.
"""

__version__ = "0.1.0"
