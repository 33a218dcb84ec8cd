"""A tiny scripted text environment for tests, benchmarks and learning smoke runs."""
