"""Device choice happens before anything starts. More than 1 GPU can't exist on this
machine, so GPU counts are passed in (``visible=``) — the one place tests stand in for hardware."""

import pytest

from nbddp.devices import Devices, resolve, visible_gpu_count
from nbddp.errors import DeviceError, UsageError


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
        ({"nproc": 3, "visible": 2}, "--nproc 3 asks for more GPUs than the 2 visible"),
    ],
)
def test_requests_this_machine_cannot_meet_exit_3(kwargs, message):
    with pytest.raises(DeviceError, match=message) as info:
        resolve(**kwargs)
    assert info.value.exit_code == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpus": "0", "visible": 2}, "at least 1 GPU"),
        ({"gpus": "two", "visible": 2}, "give a number or 'all'"),
        ({"cpu": True, "nproc": 0}, "need at least 1 process"),
        ({"nproc": 0, "visible": 0}, "need at least 1 process"),
        ({"cpu": True, "gpus": "1"}, "contradict"),
        ({"gpus": "1", "nproc": 2, "visible": 2}, "--nproc counts CPU processes"),
    ],
)
def test_values_that_can_never_work_are_usage_errors_exit_2(kwargs, message):
    with pytest.raises(UsageError, match=message) as info:
        resolve(**kwargs)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("value, count", [
    (None, 4), ("", 0), ("-1", 0), ("0,1", 2), ("2", 1), ("1,-1,2", 1), ("0,9,1", 1),
    ("GPU-8a2f,GPU-77c1", 2), ("0,1,2,3,4,5", 4),
])
def test_cuda_visible_devices_narrows_a_simulated_count(monkeypatch, value, count):
    """4 physical GPUs simulated (none exist here); removing the narrowing makes these fail."""
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_gpu_count(physical=4) == count
