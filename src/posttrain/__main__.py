"""`python -m posttrain ...` is `posttrain ...`."""

from posttrain.cli import run

run()
