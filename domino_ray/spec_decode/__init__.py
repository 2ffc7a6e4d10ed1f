"""Speculative decoding: the Domino draft and its checkpoint layouts, the proposer, verification (acceptance), the
adaptive verify width and its cost table, the acceptance statistics. Imports the target, KV and backend layers."""
