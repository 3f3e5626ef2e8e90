"""Levers of the passes on a GPU, checked on the CPU against the paths they replace, bit for bit.

The entropy metric's pieces (training/logprobs.entropy_rows): 16 positions on the CPU, sized by memory on a GPU.
Each row's sum is its own, so any piece size gives the same bits (pieces of two rows or more: torch splits a
single output's reduction over threads, in another order, on the CPU and on a GPU alike).
"""

import pytest
import torch

from posttrain.runtime.syncs import HostSyncs
from posttrain.training import logprobs
from posttrain.training.logprobs import entropy_rows, log_prob_and_entropy


def test_entropy_pieces_are_16_positions_on_the_cpu_and_sized_by_memory_on_a_gpu(monkeypatch):
    assert entropy_rows(torch.device("cpu"), 151936) == 16
    # 1 GiB over two float32 [rows, 151936] temporaries: 2**30 // (2 * 4 * 151936) = 883 rows
    assert entropy_rows(torch.device("cuda", 0), 151936) == 883
    assert entropy_rows(torch.device("cuda"), 151936, itemsize=2) == 1766
    assert entropy_rows(torch.device("cuda"), 1 << 40) == 1  # at least one row
    monkeypatch.setattr(logprobs, "ENTROPY_BYTES_GPU", 8 * 1000 * 3)
    assert entropy_rows(torch.device("cuda"), 1000) == 3


@pytest.mark.parametrize("vocab", [40, 151936])
def test_entropy_is_the_same_bits_for_any_piece_size(monkeypatch, vocab):
    """Pieces of 2, 3, 16 (the CPU's), 34 (all) positions and the GPU's sizing forced here give the same bits,
    with no host read."""
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 17, vocab, generator=g) * 4, torch.randint(0, vocab, (2, 17), generator=g)
    want = log_prob_and_entropy(logits, tokens)
    for rows in (2, 3, 34):
        monkeypatch.setattr(logprobs, "ENTROPY_ROWS", rows)
        with HostSyncs() as syncs:
            got = log_prob_and_entropy(logits, tokens)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and syncs.count == 0, rows
    monkeypatch.setattr(logprobs, "ENTROPY_BYTES_GPU", 2 * 4 * vocab * 5)  # a GPU's rule, 5 rows a piece
    monkeypatch.setattr(logprobs, "entropy_rows", lambda device, v, size: entropy_rows(torch.device("cuda"), v, size))
    assert torch.equal(log_prob_and_entropy(logits, tokens)[1], want[1])
