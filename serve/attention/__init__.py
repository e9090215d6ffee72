"""Attention backends: each turns the q/k/v of new tokens into attention output over a paged KV cache."""
