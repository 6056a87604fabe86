"""Scores, analytic OPs and payload accounting."""
