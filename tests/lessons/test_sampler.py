"""SamplerExplorer: its table is PyTorch's DistributedSampler's, and every control updates it in place."""

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ampviz.lessons.sampler import SamplerExplorer, sampler_table


def sampler_oracle(n, world, epoch, rank, set_epoch=True, **kw):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=0, **kw)
    if set_epoch:
        s.set_epoch(epoch)
    return list(s)


def test_explorer_shows_the_real_sampler_and_updates_in_place():
    w = SamplerExplorer(n=10, world_size=2, epochs=3)
    assert w.table.shape == (3, 2, 5)
    assert w.table[1, 1].tolist() == sampler_oracle(10, 2, 1, 1)
    fig = w.figure
    assert np.asarray(fig.data[0].z)[-1].tolist() == w.table[0, 0].tolist()    # top row: epoch 0, rank 0
    assert "no" in w.readout.value.split("every epoch the same order")[1][:80]
    w.set_epoch_box.value = False
    assert w.figure is fig and all(np.array_equal(w.table[0], w.table[e]) for e in range(3))
    assert "without set_epoch" in fig.layout.title.text
    assert "yes" in w.readout.value.split("every epoch the same order")[1][:80]
    w.world_slider.value = 3                                  # 10 on 3 ranks: 4 each, two repeats
    assert w.table.shape == (3, 3, 4) and len(fig.data[0].y) == 9
    assert w.table[0, 2].tolist() == sampler_oracle(10, 3, 0, 2, set_epoch=False)
    assert "2 example(s) appear twice" in w.readout.value
    w.drop_last_box.value = True
    assert w.table.shape == (3, 3, 3) and "1 example(s) unused" in w.readout.value
    w.shuffle_box.value = False
    assert w.table[0, 0].tolist() == [0, 3, 6]


def test_explorer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size: expected an integer from 1 to 8, got 0"):
        SamplerExplorer(world_size=0)
    with pytest.raises(ValueError, match="n: expected an integer from 2 to 40, got 100"):
        SamplerExplorer(n=100)


def test_sampler_table_matches_torch_randperm_oracle():
    n, world, epochs, seed = 10, 2, 3, 7
    table = sampler_table(n, world, epochs, seed=seed)
    assert table.shape == (epochs, world, n // world)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for rank in range(world):
            assert table[epoch, rank].tolist() == order[rank::world]


def test_sampler_table_set_epoch_and_partition():
    with_epoch = sampler_table(12, 3, 4, set_epoch=True)
    without = sampler_table(12, 3, 4, set_epoch=False)
    for epoch in range(4):                       # each epoch the ranks split the data set exactly
        assert sorted(with_epoch[epoch].ravel().tolist()) == list(range(12))
    assert all(np.array_equal(without[0], without[e]) for e in range(4))
    assert not np.array_equal(with_epoch[0], with_epoch[1])
    np.testing.assert_array_equal(with_epoch[0], without[0])          # epoch 0 is the same either way
    padded = sampler_table(5, 2, 1, shuffle=False)                    # 5 items on 2 ranks: one repeats
    assert padded.tolist() == [[[0, 2, 4], [1, 3, 0]]]
    assert sampler_table(5, 2, 1, shuffle=False, drop_last=True).tolist() == [[[0, 2], [1, 3]]]
    with pytest.raises(ValueError, match="world_size: expected an integer >= 1, got 0"):
        sampler_table(4, 0)


def test_every_control_changes_the_figure_from_the_first_state():
    import plotly.io as pio
    for name, value in (("n_slider", 9), ("world_slider", 3), ("set_epoch_box", False), ("shuffle_box", False),
                        ("drop_last_box", True)):
        w = SamplerExplorer()
        assert w.figure.layout.template == pio.templates["simple_white"]      # the project's theme
        before = (np.asarray(w.figure.data[0].z).tolist(), w.figure.layout.title.text, w.readout.value)
        getattr(w, name).value = value
        after = (np.asarray(w.figure.data[0].z).tolist(), w.figure.layout.title.text, w.readout.value)
        assert after[0] != before[0], f"{name}: the heatmap did not change"
