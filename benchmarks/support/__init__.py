"""Helpers shared by the benchmarks (not scripts): timing, tables, the wide test configuration, the vLLM adapter."""
