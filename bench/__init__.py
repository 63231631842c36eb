"""Benchmarks of Conveyor against in-process generation and a naive one-request-at-a-time server."""
