"""Processes: start a local world that never hangs or orphans, its forkserver, per-rank
progress, and what a rank prints."""
