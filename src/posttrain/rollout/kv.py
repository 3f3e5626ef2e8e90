"""A key/value cache for decoding that is written in place.

transformers' DynamicCache grows each layer with `torch.cat` at every
decoding step, which copies the whole cache each time: for a batch of n
samples sharing a long prompt that copy costs as much as the attention
itself. `reserve(cache, extra, repeats)` moves each layer of a prefilled
DynamicCache into a buffer with room for `extra` more tokens (repeating
each row `repeats` times, for the samples of a prompt); a step then writes
its token into the buffer and attention reads a view of it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

# The name of a model's KV-cache argument and output field. transformers renamed it from
# `past_key_values` to `cache` (5.24 has the new name, and the old one warns that it goes in
# 5.40); the 5.17 of the GPU image has only the old one.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_of(out):
    """The KV cache a forward with use_cache=True returned (out.cache; out.past_key_values before the rename)."""
    return getattr(out, CACHE)


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values [B, H, T, D] are views of buffers
    [B, H, T + room, D]; it grows into a larger buffer only when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, repeats: int = 1):
        super().__init__()
        b, h, t, d = keys.shape
        self._k = keys.new_empty((b * repeats, h, t + room, d))
        self._v = values.new_empty((b * repeats, values.shape[1], t + room, values.shape[3]))
        self._k[:, :, :t] = keys.repeat_interleave(repeats, dim=0) if repeats > 1 else keys
        self._v[:, :, :t] = values.repeat_interleave(repeats, dim=0) if repeats > 1 else values
        self._len = t
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        if self._len + t > self._k.shape[2]:  # out of room: a larger buffer (rare)
            grow = max(t, self._k.shape[2])
            self._k = torch.cat([self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[3]))], dim=2)
            self._v = torch.cat([self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[3]))], dim=2)
        self._k[:, :, self._len:self._len + t] = key_states
        self._v[:, :, self._len:self._len + t] = value_states
        self._len += t
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k, self._v = self._k.repeat_interleave(repeats, dim=0), self._v.repeat_interleave(repeats, dim=0)
        self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers' convention:
        a negative count; the buffer keeps its room)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        self._len = max(0, self._len + tokens_to_remove)
        self._views()


def reserve(cache, room: int, repeats: int = 1):
    """Move every layer of a prefilled DynamicCache into a ReservedLayer with
    `room` free positions, each row repeated `repeats` times. -> the cache."""
    cache.layers = [ReservedLayer(layer.keys, layer.values, room, repeats) for layer in cache.layers]
    return cache
