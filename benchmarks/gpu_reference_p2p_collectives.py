"""Reference results for notebooks 02 and 03, measured on a machine with 2+ GPUs:
ping-pong round trips (NCCL on GPUs, Gloo on the host's CPUs) and which
collectives Gloo and NCCL support on CUDA tensors.

    python benchmarks/gpu_reference_p2p_collectives.py [--out notebooks/reference]
"""
import argparse
import datetime
import platform
import subprocess

import torch

from ddp_helpers import WorkerError, WorkerTimeout, launch, machine, reference
from ddp_helpers.collectives import ping_pong, probe_support

SIZES = [2 ** k for k in range(0, 25, 2)]  # 1 B .. 16 MiB


def meta_for(hardware, interconnect, backend):
    return {"hardware": hardware, "interconnect": interconnect, "backend": backend,
            "torch": torch.__version__, "nccl": machine.nccl_version(), "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "command": "python benchmarks/gpu_reference_p2p_collectives.py"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=reference.REFERENCE_DIR)
    args = parser.parse_args()
    print(machine.summary_line())
    if machine.gpu_count() < 2:
        raise SystemExit("needs 2 GPUs: run this on a GPU machine")
    names = machine.gpu_names()
    hardware = f"{len(names)}x {names[0]}"
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    interconnect = "NVLink" if " NV" in topo else "PCIe"
    for backend, device, name in (("nccl", "cuda", "pingpong_nccl"), ("gloo", "cpu", "pingpong_gloo_gpuhost")):
        rows = launch(ping_pong, 2, backend=backend, args=(SIZES,), kwargs={"iters": 50, "warmup": 10,
                      "device": device}, timeout=300)[0]
        table = [{"bytes": size, "round_trip_us": round(us, 2)} for size, us in rows]
        for row in table:
            print(name, row)
        reference.save(name, table, meta_for(hardware if device == "cuda" else f"CPU of the {hardware} host",
                                              interconnect if device == "cuda"
                                              else "loopback TCP (Gloo's only transport here)",
                                              backend), args.out)
    support = []
    for backend in ("gloo", "nccl"):
        try:
            found = launch(probe_support, 2, backend=backend, args=("cuda",), timeout=60)[0]
        except WorkerError:  # an op that fails on one rank and hangs on the other: one op per launch
            found = {}
            for op in launch(probe_support, 1, backend=backend, args=("cuda",), timeout=60)[0]:
                try:
                    found.update(launch(probe_support, 2, backend=backend, args=("cuda", op), timeout=20)[0])
                except WorkerTimeout:
                    found[op] = "✘ hangs"
                except WorkerError as err:
                    found[op] = f"✘ {err.exc_type or 'crash'}"
        support += [{"backend": backend, "op": op, "result": result} for op, result in found.items()]
    for row in support:
        print("support", row)
    reference.save("support_gpu", support, meta_for(hardware, interconnect, "gloo and nccl"), args.out)


if __name__ == "__main__":
    main()
