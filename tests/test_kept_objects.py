"""What a warm rank keeps of a setup's objects: which cell made each, which changed it, and putting back what a
run changed (or saying it can't). In one process: the objects are real, torch's and NumPy's too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbddp.rank_side.warm.kept_objects import UNKEEPABLE, KeptObjects, NotKept


def kept(namespace: dict, tmp_path, cells: int = 1) -> KeptObjects:
    objects = KeptObjects(namespace, tmp_path)
    for cell in range(cells):
        objects.walk(cell)
    objects.seal(cells - 1)
    return objects


SETUP = """
class Config:
    count = 0

def counter():
    seen = []
    def add(x):
        seen.append(x)
        return len(seen)
    return add

def remember(x, cache={}):
    cache[x] = True
    return len(cache)

cfg, history, table, tags = Config(), [1, 2], {"a": [1]}, {"x"}
cfg.lr = 0.1
add = counter()
"""


def test_containers_attributes_closures_and_classes_are_put_back_in_place(tmp_path):
    namespace = {"__name__": "__main__"}
    exec(SETUP, namespace)
    objects = kept(namespace, tmp_path)
    history, table, tags, cfg, Config, add = (namespace[n] for n in ("history", "table", "tags", "cfg", "Config", "add"))

    history.append(3)  # what a training cell does to the setup's objects
    table["a"].append(2)
    table["b"] = 1
    tags.add("y")
    cfg.lr, cfg.extra = 0.5, True
    Config.count += 1
    add(7)
    namespace["remember"](1)
    assert objects.restore() == []
    assert history == [1, 2] and table == {"a": [1]} and tags == {"x"} and vars(cfg) == {"lr": 0.1}
    assert Config.count == 0 and add(1) == 1  # the closure's list is empty again
    assert namespace["remember"](2) == 1  # so is the mutable default
    assert namespace["history"] is history  # in place: whatever refers to them sees the setup's state


def test_parameters_optimizer_state_and_random_generators_come_back_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(5)
    namespace = {"model": model, "opt": opt, "generator": generator, "rng": rng}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    draws = (torch.rand(3, generator=generator), rng.random(3))
    objects = kept(namespace, tmp_path)
    generator.set_state(generator.get_state())  # (sealed: the states above are the ones restored)
    torch.manual_seed(0)
    gen_state = generator.get_state()

    for _ in range(3):
        loss = model(torch.randn(16, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for p in model.parameters():
        p.data.add_(1)  # an old-style update: no version counter sees it
    torch.rand(3, generator=generator)
    rng.random(10)
    assert objects.restore() == []
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert model.training and len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    assert torch.equal(generator.get_state(), gen_state)
    assert np.array_equal(rng.random(3), draws[1]) is False  # drawn after the copy: the next 3 differ…
    assert objects.restore() == []  # …and are put back again
    assert np.array_equal(np.random.default_rng(5).random(6)[3:], rng.random(3))


def test_a_big_tensor_is_checked_not_copied_and_a_change_is_reported_however_it_was_made(tmp_path):
    data = torch.randn(600_000)  # 2.4 MB: above SMALL_BYTES, no gradient: a dataset
    array = np.arange(400_000, dtype=np.float64)
    namespace = {"data": data, "array": array}
    objects = kept(namespace, tmp_path)
    assert objects.restore() == []
    assert all(r.copy is None for r in objects.records.values())

    data.data[0] += 1  # through .data: the version counter doesn't move, the checksum does
    assert [r.name() for r, _ in objects.restore()] == ["data"]
    data.data[0] -= 1
    array.view()[5] = -1  # a NumPy view
    assert [r.name() for r, _ in objects.restore()] == ["array"]
    array[5] = 5
    data.mul_(1)  # in place, same values: the version counter says it changed
    assert [r.name() for r, _ in objects.restore()] == ["data"]


def test_each_object_knows_the_cell_that_made_it_and_the_last_that_changed_it(tmp_path):
    namespace: dict = {}
    objects = KeptObjects(namespace, tmp_path)
    namespace["items"] = []
    objects.walk(0)
    namespace["model"] = torch.nn.Linear(2, 2)
    objects.walk(1)
    namespace["items"].append(namespace["model"])
    objects.walk(2)
    with torch.no_grad():
        namespace["model"].weight.data.zero_()  # cell 3 re-initialises cell 1's model through .data
    objects.walk(3)
    objects.seal(3)
    records = {r.name(): r for r in objects.records.values()}
    assert (records["items"].birth, records["items"].changed) == (0, 2)
    assert records["model"].birth == 1
    assert records["model.weight"].changed == 3  # seen by its checksum at the end of setup
    objects.drop_from(1)
    assert {r.name() for r in objects.records.values()} == {"items"}


def test_what_cant_be_kept_is_named_and_nothing_is_kept_that_wont_fit(tmp_path):
    handle = open(tmp_path / "log.txt", "w")
    try:
        namespace = {"log": handle, "lines": (x for x in range(3)), "model": torch.nn.Linear(100, 100)}
        objects = kept(namespace, tmp_path)
        whys = {r.name(): r.why for r in objects.records.values() if r.kind == UNKEEPABLE}
        assert whys == {"log": "an open file", "lines": "a generator"}
        assert {r.name() for r, _ in objects.restore()} == {"log", "lines"}
        small = KeptObjects({"model": namespace["model"]}, tmp_path)
        small.walk(0)
        with pytest.raises(NotKept, match=r"copying what a run changes \(40.4 kB\) would not fit in memory \(1 kB free\)"):
            small.seal(0, available=1000)
    finally:
        handle.close()
