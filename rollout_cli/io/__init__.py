"""Parquet in and out: a streaming prompt reader and an atomic sharded trajectory writer."""
