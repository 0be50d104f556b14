"""NOTE [seeded generators]: a sample is loaded with the global generators it draws from seeded by
``(seed, epoch, index)``; a dataset that draws nothing pays no seeding, one that draws gets the same sample
whichever batch, rank or DataLoader worker loads it, and the training process's own streams do not move."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fusetrain.training.distributed import global_order
from fusetrain.training.distributed.global_order import GENERATORS, SeededSamples

N = 24


class Draws(Dataset):
    """Sample ``i`` is ``i`` plus a draw from each generator in ``uses`` (only for odd ``i`` with ``odd_only``)."""

    def __init__(self, uses, odd_only=False):
        self.uses, self.odd_only = uses, odd_only

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = torch.full((3,), float(i))
        if self.odd_only and i % 2 == 0:
            return x
        if "torch" in self.uses:
            x = x + torch.rand(3)
        if "numpy" in self.uses:
            x = x + torch.from_numpy(np.random.rand(3)).float()
        if "random" in self.uses:
            x = x + torch.tensor([random.random() for _ in range(3)])
        return x


def _states():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same_states(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:] and a[2] == b[2]


def test_a_dataset_that_draws_nothing_is_seeded_never():
    data = SeededSamples(TensorDataset(torch.arange(N).float()), seed=3)
    before = _states()
    for start in range(0, N, 6):
        data.__getitems__([(0, i) for i in range(start, start + 6)])
    assert data.seeded == () and data.watched == GENERATORS
    assert _same_states(before, _states())


@pytest.mark.parametrize("uses", [("torch",), ("numpy",), ("random",), ("numpy", "random"), GENERATORS])
def test_the_generators_drawn_from_are_found_and_seeded(uses):
    data = SeededSamples(Draws(uses), seed=3)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = _states()
    batch = data.__getitems__([(1, i) for i in range(6)])
    assert data.seeded == tuple(g for g in GENERATORS if g in uses)
    assert data.watched == tuple(g for g in GENERATORS if g not in uses)
    # The training process's streams are where they were, and the sample does not depend on them or its batch.
    assert _same_states(before, _states())
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    alone = SeededSamples(Draws(uses), seed=3)
    assert torch.equal(alone[(1, 4)], batch[4])
    assert not torch.equal(alone[(2, 4)], batch[4]) and not torch.equal(alone[(1, 5)] - 1, batch[4])


def test_workers_load_what_the_main_process_loads_also_for_conditional_draws():
    keys = [(2, i) for i in range(N)]
    data = SeededSamples(Draws(GENERATORS, odd_only=True), seed=11)
    main = torch.cat(list(DataLoader(data, batch_size=4, sampler=keys)))
    workers = torch.cat(list(DataLoader(SeededSamples(Draws(GENERATORS, odd_only=True), seed=11), batch_size=3,
                                        num_workers=2, sampler=keys)))
    assert torch.equal(main, workers)
    # Even samples draw nothing: they are their index.
    assert torch.equal(main[0::2], torch.arange(0, N, 2).float()[:, None].expand(-1, 3))


def test_a_draw_that_depends_on_another_generator_is_found_too():
    class Chained(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            x = torch.rand(())  # seeded from the first batch on; unseeded it may skip the branch
            return x + (float(np.random.rand()) if x < 0.5 else 0.0)

    seen = [SeededSamples(Chained(), seed=5)[(0, i)] for i in range(N)]
    data = SeededSamples(Chained(), seed=5)
    batch = data.__getitems__([(0, i) for i in range(N)])
    assert data.seeded == ("torch", "numpy")
    assert all(torch.equal(a, b) for a, b in zip(seen, batch))


def test_declared_generators_are_seeded_without_watching():
    class Declared(Draws):
        random_generators = ("torch",)

    data = SeededSamples(Declared(("torch",)), seed=3)
    assert data.seeded == ("torch",) and data.watched == ()
    assert torch.equal(data[(0, 2)], SeededSamples(Draws(("torch",)), seed=3)[(0, 2)])
    nothing = type("Nothing", (Draws,), {"random_generators": ()})(())
    assert SeededSamples(nothing, seed=3).watched == ()


@pytest.mark.parametrize("bad", ["torch", ("torch", "cuda"), 3])
def test_a_bad_declaration_names_the_attribute(bad):
    ds = TensorDataset(torch.zeros(2))
    ds.random_generators = bad
    with pytest.raises(ValueError, match=r"TensorDataset.random_generators: got .*; allowed: a tuple of 'torch', "
                                         r"'numpy', 'random'"):
        SeededSamples(ds, seed=0)


def test_a_batched_dataset_is_read_in_one_call_when_nothing_is_seeded():
    class Batched(TensorDataset):
        calls = 0

        def __getitems__(self, indices):
            Batched.calls += 1
            return [self[i] for i in indices]

    data = SeededSamples(Batched(torch.arange(N).float()), seed=0)
    got = data.__getitems__([(0, i) for i in (3, 1, 2)])
    assert Batched.calls == 1 and [t[0].item() for t in got] == [3.0, 1.0, 2.0]


def test_the_raw_mark_of_pythons_generator_reads_its_state():
    # Where CPython's layout holds, the mark is read in place; either way it moves with a draw and restores.
    mark = global_order._random_mark()
    state = random.getstate()
    random.random()
    assert global_order._random_mark() != mark
    global_order._random_restore_mark(mark)
    assert random.getstate() == state
