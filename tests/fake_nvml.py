"""A fake NVML for the tests: a real shared library, ``libnvidia-ml.so.1``, built with the C compiler, that says what
``FAKE_NVML`` describes, so nbddp's own ctypes calls (:mod:`nbddp.contracts.devices`) meet GPUs on a machine with none.

A fake, because several GPUs, busy or missing, can't exist here (no GPU); everything above the driver's library is
real: the process that loads it finds it on ``LD_LIBRARY_PATH`` as it would find the driver's.

``FAKE_NVML``: one entry per GPU, ``;``-separated: ``UUID:USED_MIB:TOTAL_MIB:PID@MIB,PID@MIB`` (no processes: nothing
after the third ``:``; the PID ``parent``: the parent of the process asking, as a kernel is of its doctor's checks).
The driver's version is ``555.42.06``. ``FAKE_NVML_HANG`` set: ``nvmlInit`` never returns, as a driver whose GPU fell
off the bus.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct { unsigned int pid; unsigned long long used; unsigned int gi; unsigned int ci; } proc_t;
typedef struct { unsigned long long total, free, used; } mem_t;

#define MAX 16
static int count;
static char uuids[MAX][80];
static unsigned long long used[MAX], total[MAX];
static unsigned int pids[MAX][8];
static unsigned long long held[MAX][8];
static int npids[MAX];

static void load(void) {
    const char *given = getenv("FAKE_NVML");
    count = 0;
    if (!given || !*given) return;
    char *text = strdup(given), *gpu, *outer;
    for (gpu = strtok_r(text, ";", &outer); gpu && count < MAX; gpu = strtok_r(NULL, ";", &outer)) {
        char *field[4] = {0}, *inner, *part = strtok_r(gpu, ":", &inner);
        for (int f = 0; part && f < 4; f++, part = strtok_r(NULL, ":", &inner)) field[f] = part;
        snprintf(uuids[count], 80, "%s", field[0] ? field[0] : "GPU-fake");
        used[count] = (field[1] ? strtoull(field[1], 0, 10) : 0) << 20;
        total[count] = (field[2] ? strtoull(field[2], 0, 10) : 81920) << 20;
        npids[count] = 0;
        if (field[3]) {
            char *each, *third;
            for (each = strtok_r(field[3], ",", &third); each && npids[count] < 8; each = strtok_r(NULL, ",", &third)) {
                char *at = strchr(each, '@');
                pids[count][npids[count]] = strncmp(each, "parent", 6) == 0 ? (unsigned int) getppid()
                                                                            : (unsigned int) strtoul(each, 0, 10);
                held[count][npids[count]] = (at ? strtoull(at + 1, 0, 10) : 0) << 20;
                npids[count]++;
            }
        }
        count++;
    }
    free(text);
}

int nvmlInit_v2(void) {
    if (getenv("FAKE_NVML_HANG")) sleep(3600);  /* a driver that stopped answering */
    load(); return 0;
}
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = count; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **handle) {
    if ((int) i >= count) return 2;
    *handle = (void *) (long) (i + 1); return 0;
}
int nvmlDeviceGetUUID(void *handle, char *text, unsigned int length) {
    snprintf(text, length, "%s", uuids[(long) handle - 1]); return 0;
}
int nvmlDeviceGetMemoryInfo(void *handle, mem_t *memory) {
    long i = (long) handle - 1;
    memory->total = total[i]; memory->used = used[i]; memory->free = total[i] - used[i]; return 0;
}
int nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *n, proc_t *table) {
    long i = (long) handle - 1;
    if (!table || *n < (unsigned int) npids[i]) { int had = npids[i]; *n = npids[i]; return had ? 7 : 0; }
    for (int p = 0; p < npids[i]; p++) {
        table[p].pid = pids[i][p]; table[p].used = held[i][p]; table[p].gi = 0; table[p].ci = 0;
    }
    *n = npids[i]; return 0;
}
int nvmlSystemGetDriverVersion(char *text, unsigned int length) { snprintf(text, length, "555.42.06"); return 0; }
"""


def build(folder: Path) -> Path:
    """``folder/libnvidia-ml.so.1``, compiled: the folder to put on ``LD_LIBRARY_PATH``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("a C compiler (Debian's gcc) builds the fake NVML: .ci/run installs it")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fake_nvml.c").write_text(SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(folder / "libnvidia-ml.so.1"),
                    str(folder / "fake_nvml.c")], check=True, capture_output=True)
    return folder


def environment(folder: Path, gpus: str) -> dict[str, str]:
    """What a process needs to meet the GPUs ``gpus`` (``FAKE_NVML``'s format) through the fake."""
    return {"LD_LIBRARY_PATH": str(folder), "FAKE_NVML": gpus}
