"""Metrics: names, the console line, loggers, sample completions, FLOPs and MFU."""
