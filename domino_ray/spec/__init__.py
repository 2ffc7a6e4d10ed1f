"""Speculative decoding: the Domino draft and its checkpoints, the proposer, verification and sampling, the
adaptive verify width and the acceptance statistics. Imports the model layer and below."""
