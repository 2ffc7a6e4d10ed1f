"""domino-ray: lossless speculative decoding with Domino drafts, batch on Ray Data and online on Ray Serve."""

__version__ = "0.1.0"
