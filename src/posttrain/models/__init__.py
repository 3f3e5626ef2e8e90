"""Models: loading from a Hugging Face directory, and the shipped tiny models (shipped.py)."""

from posttrain.models.loader import check_model_dir, load_model, load_tokenizer, load_value_model

__all__ = ["check_model_dir", "load_model", "load_tokenizer", "load_value_model"]
