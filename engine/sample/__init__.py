"""Tokens from logits: the sampler, and speculative decoding's proposer and verification."""
