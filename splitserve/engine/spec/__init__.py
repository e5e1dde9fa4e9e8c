"""Speculative decoding: n-gram drafts (ngram.py), the scheduler's speculator
(speculator.py) and verification by rejection sampling (verify.py)."""
