"""Text: one-line summaries, the invalid-unicode check, credentials redacted."""
