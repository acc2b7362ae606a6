"""Benchmarks: drafters side by side in one process (speed), the served engine under load
(perf, soak), and beside busy neighbours (contend)."""
