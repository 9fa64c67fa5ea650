"""pt2-handlers: TorchServe handlers that make torch.compile safe to turn on in production.

Importing this package does nothing else: no torch flags, no environment reads, no TorchServe import.
The TorchServe entry point is ``handlers.torchserve_handler.Pt2Handler``.
"""

__version__ = "0.1.0"
