"""Infrastructure for ldt's own tests and benchmarks (not needed to train)."""
