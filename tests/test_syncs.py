"""HostSyncs counts what makes the host wait for the device: scalar reads, data-sized outputs, host reads."""

import torch

from posttrain.runtime.syncs import HostSyncs


def test_each_kind_of_host_sync_is_counted_and_device_side_work_is_not():
    x = torch.tensor([1, 0, 3])
    mask = x > 0
    with HostSyncs() as syncs:
        x.tolist()
        bool(mask.any())  # a scalar read
        float(x.sum())
        x[mask]  # a boolean mask's indexing: its output size is the mask's count
        y = x.clone()
        y[mask] = 0
        torch.nonzero(mask)
        torch.equal(x, y)
    assert dict(syncs.by_op) == {"Tensor.tolist": 1, "aten._local_scalar_dense": 2, "aten.index": 1,
                                 "aten.index_put_": 1, "aten.nonzero": 1, "aten.equal": 1}
    with HostSyncs() as syncs:  # all of it stays on the device
        z = x.masked_fill(mask, 0) + torch.where(mask, x, -x)
        z[torch.tensor([0, 2])] = 5  # integer indices: no size to learn
        z.cumsum(0).argmax()
    assert syncs.count == 0
