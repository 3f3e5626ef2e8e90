"""The driver: building a run, the RL and SFT loops, sampling and scoring, validation."""
