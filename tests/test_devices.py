"""Device choice happens before anything starts. More than 1 GPU can't exist on this
machine, so GPU counts are passed in (``visible=``) — the one place tests stand in for hardware."""

import pytest

from nbddp.devices import Devices, resolve, visible_gpu_count
from nbddp.errors import DeviceError


def test_no_gpu_defaults_to_two_cpu_processes_and_says_so():
    devices = resolve(visible=0)
    assert devices == Devices("cpu", 2, devices.note)
    assert "no GPU visible" in devices.note and "2 processes" in devices.note


def test_cpu_flag_and_nproc():
    assert resolve(cpu=True, nproc=3, visible=4) == Devices("cpu", 3)


def test_gpus_default_to_all_visible():  # simulated: 4 GPUs cannot exist here
    assert resolve(visible=4) == Devices("cuda", 4)
    assert resolve(gpus="all", visible=4) == Devices("cuda", 4)
    assert resolve(gpus="2", visible=4) == Devices("cuda", 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpus": "4", "visible": 2}, "--gpus 4 asks for more GPUs than the 2 visible"),
        ({"gpus": "4", "visible": 0}, "--gpus 4 asks for more GPUs than the 0 visible"),
        ({"gpus": "all", "visible": 0}, "no GPU is visible"),
        ({"gpus": "0", "visible": 2}, "at least 1 GPU"),
        ({"gpus": "two", "visible": 2}, "give a number or 'all'"),
        ({"cpu": True, "nproc": 0}, "need at least 1 process"),
        ({"cpu": True, "gpus": "1"}, "contradict"),
    ],
)
def test_impossible_requests_fail_early(kwargs, message):
    with pytest.raises(DeviceError, match=message) as info:
        resolve(**kwargs)
    assert info.value.exit_code == 3


def test_cuda_visible_devices_narrows(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpu_count() == 0
