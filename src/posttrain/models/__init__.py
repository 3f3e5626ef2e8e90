"""Models: loading from a Hugging Face directory, and the embedded tiny model."""

from posttrain.models.loader import check_model_dir, load_model, load_tokenizer, load_value_model
from posttrain.models.tiny import TinySpec, build_tiny_model, cache_root, ensure_tiny_model

__all__ = ["check_model_dir", "load_model", "load_tokenizer", "load_value_model", "TinySpec", "build_tiny_model", "cache_root",
           "ensure_tiny_model"]
