"""Device choice happens before anything starts. More than 1 GPU can't exist on this
machine, so GPU counts are passed in (``visible=``) — the one place tests stand in for hardware."""

import pytest

from nbddp.contracts.devices import Devices, GpuUse, free_devices, gpu_usage, rank_gpu, resolve, visible_gpu_count, wait_for_free
from nbddp.contracts.errors import DeviceError, UsageError


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
        ({"gpus": "two", "visible": 2}, "give a number, 'all' or 'free'"),
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


# ---------------------------------------------------------------- a notebook's own process count
# (Script.processes: `notebook_launcher(num_processes=N)`, `Trainer(devices=N)`.) GPU counts are passed in
# (``visible=``): this machine has none; 1, 2, 4 and 8 stand for the machines the notebooks must run on.


@pytest.mark.parametrize("visible", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("asked", [1, 2, 4, 8])
def test_a_notebooks_process_count_runs_as_shipped_on_any_machine(visible, asked):
    """On the CPU the literal is the CPU process count; on GPUs one process per GPU, at most every visible one."""
    from nbddp.launchers import devices_for
    from nbddp.plan.options import LaunchOptions

    devices = devices_for(LaunchOptions(), visible=visible, asked=asked)
    if visible == 0:
        assert (devices.kind, devices.nproc) == ("cpu", asked)
        assert devices.note == f"{asked} CPU processes (gloo), as the notebook asks (--gpus / --nproc choose otherwise)."
    elif asked <= visible:
        assert (devices.kind, devices.nproc) == ("cuda", asked) and "as the notebook asks" in devices.note
    else:
        assert (devices.kind, devices.nproc) == ("cuda", visible)
        verb = "is" if visible == 1 else "are"
        gpus = f"{visible} GPU{'s' * (visible != 1)}"
        assert devices.note == (f"the notebook asks for {asked} processes and {gpus} {verb} visible: training on "
                                f"{gpus}, one process each (--cpu runs {asked} CPU processes instead).")
    on_cpu = devices_for(LaunchOptions(cpu=True), visible=visible, asked=asked)
    assert (on_cpu.kind, on_cpu.nproc) == ("cpu", asked)


@pytest.mark.parametrize("visible", [1, 2, 4])
def test_an_explicit_count_beyond_the_visible_gpus_stays_an_error_exit_3(visible):
    from nbddp.launchers import devices_for
    from nbddp.plan.options import LaunchOptions

    for launch, said in ((LaunchOptions(gpus=str(visible * 2)), f"--gpus {visible * 2}"),
                         (LaunchOptions(nproc=visible * 2), f"--nproc {visible * 2}")):
        with pytest.raises(DeviceError, match=f"{said} asks for more GPUs than the {visible} visible") as info:
            devices_for(launch, visible=visible, asked=2)
        assert info.value.exit_code == 3
    assert devices_for(LaunchOptions(gpus="1"), visible=visible, asked=8) == Devices("cuda", 1)
    assert devices_for(LaunchOptions(nproc=3), visible=0, asked=8) == Devices("cpu", 3, devices_for(
        LaunchOptions(nproc=3), visible=0).note)


# ---------------------------------------------------------------- each rank's own GPU
# Several GPUs, and several GPU nodes, cannot exist here: the GPU count a rank's torch would report
# (torch.cuda.device_count()) is passed in. What torchrun, Ray and a batch give each rank is real code.


@pytest.mark.parametrize("per_node", [1, 2, 4, 8])
@pytest.mark.parametrize("nnodes", [1, 2, 3])
def test_every_rank_of_every_node_drives_a_gpu_of_its_own(per_node, nnodes):
    from nbddp.launchers import devices_for
    from nbddp.launchers.torchrun import torchrun_options
    from nbddp.plan.options import LaunchOptions

    devices = devices_for(LaunchOptions(), visible=per_node)  # what each node runs: all its GPUs
    assert devices == Devices("cuda", per_node)
    options = torchrun_options(devices.nproc, nnodes=nnodes, node_rank=0, endpoint="node0:29500")
    assert f"--nproc-per-node={per_node}" in options
    # torchrun numbers each node's processes LOCAL_RANK 0..nproc-1, RANK node * nproc + LOCAL_RANK:
    plan = {(node, local): (node * per_node + local, rank_gpu(local, per_node, per_node))
            for node in range(nnodes) for local in range(per_node)}
    assert sorted(rank for rank, _ in plan.values()) == list(range(nnodes * per_node))
    for node in range(nnodes):
        assert sorted(plan[node, local][1] for local in range(per_node)) == list(range(per_node))  # none shared


def test_a_batch_runs_ranks_drive_their_slots_gpus(monkeypatch):
    """A batch gives each run its slot's GPUs as CUDA_VISIBLE_DEVICES; a rank's ``cuda:LOCAL_RANK`` is then
    the slot's LOCAL_RANK-th GPU, so no two runs and no two ranks share one (8 GPUs simulated)."""
    from nbddp.doors.batch import schedule
    from nbddp.doors.batch.schedule import BatchOptions, device_slots

    monkeypatch.setattr(schedule, "visible_gpu_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for per_run in (1, 2, 4, 8):
        slots, nproc, kind = device_slots(BatchOptions("nb.ipynb", {}, gpus_per_run=per_run), print)
        assert (nproc, kind, len(slots)) == (per_run, "cuda", 8 // per_run)
        physical = [slot[rank_gpu(local, len(slot), nproc)] for slot in slots for local in range(nproc)]
        assert sorted(physical, key=int) == [str(i) for i in range(8)]  # every GPU once
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(slots[-1]))  # what the last slot's run sees
        assert visible_gpu_count(physical=8) == per_run
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize("local_rank, visible, per_node, said", [
    (1, 1, 2, "local rank 1 has no GPU: 2 processes were started on this machine, one per GPU, and torch sees "
              "1 GPU here. Start 1, one per GPU: torchrun --nproc_per_node 1, or nbddp run --gpus 1 "
              "(or 2 CPU processes: nbddp run --cpu --nproc 2)."),
    (5, 4, 8, "8 processes were started on this machine, one per GPU, and torch sees 4 GPUs here. Start 4, one "
              "per GPU: torchrun --nproc_per_node 4, or nbddp run --gpus 4"),
    (2, 2, None, "local rank 2 has no GPU: 3 processes were started"),
    (0, 0, 2, "torch sees no GPU here. Train on the CPU instead: nbddp run --cpu --nproc 2."),
])
def test_a_rank_without_a_gpu_of_its_own_is_refused_in_one_line_exit_3(monkeypatch, local_rank, visible, per_node,
                                                                       said):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceError) as info:
        rank_gpu(local_rank, visible, per_node)
    assert said in str(info.value) and "\n" not in str(info.value) and info.value.exit_code == 3


def test_the_refusal_names_the_narrowing_and_the_launchers_own_command(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(DeviceError, match=r"torch sees 1 GPU here \(CUDA_VISIBLE_DEVICES=3\)\. Start 1, one per "
                                          r"GPU: NBDDP_NPROC=1 python train.py, or nbddp run --gpus 1"):
        rank_gpu(1, 1, 2, how="NBDDP_NPROC={n} python train.py")  # (Catalyst's spawn: its own count)


@pytest.mark.parametrize("local_rank, visible", [(0, 1), (1, 2), (7, 8), (3, 8)])
def test_a_rank_with_a_gpu_drives_its_local_rank(local_rank, visible):
    assert rank_gpu(local_rank, visible, visible) == local_rank


# ---------------------------------------------------------------- --gpus free and --wait on a shared GPU server
# A fake NVML: the policy is judged on machines of GpuUse rows (several GPUs, others' processes: none exist here).

GiB = 2**30
SHARED = [GpuUse(0, "GPU-0aa", 2, 30 * GiB, 80 * GiB),  # a colleague's training
          GpuUse(1, "GPU-1bb", 0, 0, 80 * GiB),
          GpuUse(2, "GPU-2cc", 0, 10 * GiB, 80 * GiB),  # memory held, no process NVML shows (another container)
          GpuUse(3, "GPU-3dd", 0, 1 * GiB, 80 * GiB)]  # a driver context: free


def test_gpus_free_takes_the_gpus_nobody_uses_by_name_and_says_which():
    devices = free_devices(None, SHARED)
    assert (devices.kind, devices.nproc, devices.gpu_ids) == ("cuda", 2, ("GPU-1bb", "GPU-3dd"))
    assert devices.environment() == {"CUDA_VISIBLE_DEVICES": "GPU-1bb,GPU-3dd"}  # by name: CUDA's order can differ
    assert devices.note == ("training on the free GPUs 1, 3 (in use: GPU 0: 2 processes, 30.0 of 80.0 GiB used; "
                            "GPU 2: 0 processes, 10.0 of 80.0 GiB used)")
    assert free_devices(1, SHARED, visible="3,1").gpu_ids == ("GPU-3dd",)  # CUDA_VISIBLE_DEVICES's order
    assert free_devices(None, SHARED, visible="GPU-1").gpu_ids == ("GPU-1bb",)  # a UUID's prefix, as CUDA takes
    assert Devices("cuda", 2).environment() == {}  # the first N visible: nothing to narrow
    # the kernel's own warm ranks on GPU 0 (a run before chose it): free to this kernel, though NVML lists them
    assert free_devices(None, SHARED, ours=("GPU-0aa",)).gpu_ids == ("GPU-0aa", "GPU-1bb", "GPU-3dd")
    unknown = [GpuUse(0, "GPU-0aa", -1, 0, 80 * GiB)]  # NVML wouldn't count its processes (a MIG parent): busy
    with pytest.raises(DeviceError, match=r"\(GPU 0: processes unknown, 0.0 of 80.0 GiB used\)"):
        free_devices(None, unknown)


@pytest.mark.parametrize("wanted, usage, visible, message", [
    (None, SHARED, "0,2", "--gpus free: 0 of the 2 visible GPUs are free (GPU 0: 2 processes, 30.0 of 80.0 GiB used; "
                          "GPU 2: 0 processes, 10.0 of 80.0 GiB used). Wait for 1 GPU to be free: --gpus 1 --wait; or "
                          "use --cpu."),
    (3, SHARED, None, "--gpus 3: 2 of the 4 visible GPUs are free (GPU 0: 2 processes, 30.0 of 80.0 GiB used; GPU 2: "
                      "0 processes, 10.0 of 80.0 GiB used). Wait for 3 GPUs to be free: --gpus 3 --wait; or use --cpu."),
    (5, SHARED, None, "--gpus 5 asks for more GPUs than the 4 visible. Use --gpus 4 or --cpu."),
    (None, [], None, "--gpus free: no GPU is visible here. Use --cpu --nproc N to run on the CPU."),
])
def test_fewer_free_gpus_than_asked_is_one_line_naming_who_holds_what_and_how_to_wait_exit_3(wanted, usage, visible,
                                                                                            message):
    with pytest.raises(DeviceError) as refused:
        free_devices(wanted, usage, visible)
    assert str(refused.value) == message and refused.value.exit_code == 3


def test_wait_says_what_it_waits_for_then_takes_the_gpus_freed(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    freed = [GpuUse(0, "GPU-0aa", 0, 0, 80 * GiB), *SHARED[1:]]
    machines = iter([SHARED, SHARED, SHARED, freed])
    said, slept, now = [], [], iter([0.0, 10.0, 70.0])
    devices = wait_for_free(3, said.append, usage=lambda: next(machines), sleep=slept.append, clock=lambda: next(now))
    assert devices.gpu_ids == ("GPU-0aa", "GPU-1bb", "GPU-3dd")
    assert said == ["waiting for 3 GPUs to be free (--wait): 2 of the 4 visible GPUs are free (GPU 0: 2 processes, "
                    "30.0 of 80.0 GiB used; GPU 2: 0 processes, 10.0 of 80.0 GiB used)"] * 2  # at once, then a minute on
    assert slept == [5.0, 5.0, 5.0]
    with pytest.raises(DeviceError, match="asks for more GPUs than the 4 visible"):  # waiting can't help: said at once
        wait_for_free(5, said.append, usage=lambda: SHARED)


def test_wait_needs_a_gpu_count_and_gpus_free_reaches_nvml_here(tmp_path):
    from nbddp.plan.options import LaunchOptions

    with pytest.raises(UsageError, match="--wait waits for free GPUs: give --gpus N"):
        LaunchOptions(wait=True)
    with pytest.raises(UsageError, match="--wait waits for free GPUs"):
        LaunchOptions(wait=True, gpus="all")
    if not gpu_usage():  # this machine: no NVML, so no GPU; one line, exit 3 (on a GPU machine: its free GPUs)
        with pytest.raises(DeviceError, match="^--gpus free: no GPU is visible here"):
            resolve("free")
