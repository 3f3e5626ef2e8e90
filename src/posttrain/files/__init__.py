"""Files: the cache directory and digests, YAML files, a user's .py files."""
