"""Attention: dense causal, paged KV cache, page selection and sparse decode."""
