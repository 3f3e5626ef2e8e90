"""The libraries' own output: posttrain shows its own progress, so their bars
and notices are turned off in every process that loads a model (the CLI's, and
each worker's)."""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    """Silence transformers' and the hub's progress bars and notices, and vLLM's INFO lines (its warnings
    stay); a user's own setting wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
