"""Datasets, tokenisation, batching and partitioning. Knows nothing about models or FL."""
