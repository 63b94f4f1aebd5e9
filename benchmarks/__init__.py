"""Benchmarks: each measures its peer in the same run and ends with one RESULT line."""
