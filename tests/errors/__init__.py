"""Mistakes and hostile inputs: each a one-line error, exit code 2, and nothing on disk touched."""
