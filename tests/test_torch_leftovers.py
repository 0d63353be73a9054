"""torch's empty compile-cache folder, which every DDP rank's import of ``torch._dynamo`` makes, is removed after
a run that made it; a real cache, a folder that was there before and a folder the user chose stay.
(A real run leaving nothing in its temp folder: tests/test_run.py::test_ddp_matches_one_process_with_double_batch.)"""

import tempfile

import pytest

from nbddp.job.torch_leftovers import TorchLeftovers, inductor_cache_folder


@pytest.fixture
def temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path


def test_an_empty_folder_the_run_made_is_removed(temp):
    leftovers = TorchLeftovers()
    leftovers.folder.mkdir()  # as a rank's `import torch._dynamo` does
    leftovers.clean()
    assert not list(temp.iterdir())


def test_a_compile_cache_and_a_folder_from_before_stay(temp):
    leftovers = TorchLeftovers()
    (leftovers.folder / "fxgraph").mkdir(parents=True)  # torch.compile wrote its cache
    leftovers.clean()
    assert (leftovers.folder / "fxgraph").is_dir()
    (leftovers.folder / "fxgraph").rmdir()
    before = TorchLeftovers()  # the folder exists as this run starts: someone else's
    before.clean()
    assert before.folder.is_dir()


def test_a_folder_the_user_chose_is_never_touched(temp, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(temp / "mine"))
    assert inductor_cache_folder() is None
    (temp / "mine").mkdir()
    TorchLeftovers().clean()
    assert (temp / "mine").is_dir()
