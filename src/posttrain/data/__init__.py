"""Datasets: the parquet schema, loading and tokenization, preprocessors."""
