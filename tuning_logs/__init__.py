"""Stored tuning results, one JSON-lines file per target and kernel (tuning_logs/<target>/<op>.jsonl)."""
