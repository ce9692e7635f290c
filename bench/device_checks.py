"""The checks of ``make device-check`` (:mod:`bench.device_check` runs each in its own process):
``python -m bench.device_checks NAME RESULT.json`` writes the check's figures and status.

With ``LDT_DEVICE_CHECK_REHEARSE=1`` the CUDA stage is a CPU stage and the models are tiny:
every check runs its whole logic and reports ``rehearsed``, never a GPU figure. The
single-stage runs (memory, speed) are in :mod:`bench.device_runs`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import traceback
import xml.etree.ElementTree as ET

from bench.device_check import FAIL, PASS, REHEARSED, SKIPPED, rehearsing

REHEARSE = rehearsing()
GPU = "cpu" if REHEARSE else "cuda"  # the device of "the GPU stage"
OUT = os.environ.get("LDT_DEVICE_CHECK_OUT", os.path.join("outputs", "device-check"))
PARITY_FP32 = 1e-5
PARITY_BF16 = 5e-2  # bf16 on the GPU against the bf16 reference on the CPU: kernels differ
# Dense bf16 peak per device (NVIDIA's data sheets), first match of the device's name wins
PEAKS = (("H200", 989.0, "H200: 989 TFLOP/s bf16 dense"),
         ("H100 PCIe", 756.0, "H100 PCIe: 756 TFLOP/s bf16 dense"),
         ("H100 NVL", 835.0, "H100 NVL: 835 TFLOP/s bf16 dense"),
         ("H100", 989.0, "H100 SXM: 989 TFLOP/s bf16 dense"))
GPU_TEST_FILES = ("tests/test_p2p_handles.py", "tests/test_boundary_transport.py")


def fresh(path: str) -> str:
    """A check's own run folder, emptied (a rerun into the same OUT starts over)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


RESULT_PATH = None  # set by main()


def save(result: dict) -> None:
    """Write the check's result file (whole, by a rename); a check that runs long calls it
    with ``status="partial"`` as its parts finish, so a timeout keeps them."""
    if RESULT_PATH is None:
        return
    tmp = RESULT_PATH + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, RESULT_PATH)


def status(ok: bool) -> str:
    return FAIL if not ok else REHEARSED if REHEARSE else PASS


def peak_tflops(device_name: str):
    """(TFLOP/s, how it is named) of the first :data:`PEAKS` entry in the device's name."""
    for key, tflops, label in PEAKS:
        if key in device_name:
            return tflops, label
    return None, f"no peak known for {device_name!r}: MFU not computed"


def device_name() -> str:
    import torch

    if REHEARSE:
        return f"CPU ({platform.processor() or platform.machine()}, rehearsal)"
    return torch.cuda.get_device_name(0)


def environment() -> dict:
    """What the environment check found (its result file): the later checks read the device
    from there, so that their own process never holds a CUDA context of its own (it would
    count in the device's used memory)."""
    try:
        with open(os.path.join(OUT, "logs", "environment.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# ---- environment --------------------------------------------------------------------------

def check_environment() -> dict:
    import importlib.metadata as md

    import torch

    def version(dist: str):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    __import__("megatron.core")  # it imports

    from ldt.topology.device import available_device_types
    from ldt.patches.registry import check_megatron_version

    name = device_name()
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "megatron_core": check_megatron_version(),
           "hydra_core": version("hydra-core"), "omegaconf": version("omegaconf"),
           "transformer_engine": version("transformer-engine") or version("transformer_engine"),
           "ldt": version("ldt"), "device": name,
           "device_types": sorted(available_device_types()),
           "peak": peak_tflops(name)[1]}
    if not REHEARSE:
        props = torch.cuda.get_device_properties(0)
        out.update(gpus=torch.cuda.device_count(), memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}",
                   bf16=torch.cuda.is_bf16_supported(),
                   # TF32 in fp32 matmuls would move the fp32 parity well above 1e-5
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   float32_matmul_precision=torch.get_float32_matmul_precision())
        try:
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out["nvidia_smi"] = None
    out["status"] = status(REHEARSE or torch.cuda.is_available())
    return out


# ---- pytest -m gpu ------------------------------------------------------------------------

def run_gpu_tests(junit: str, timeout_s: float = 120, exitfirst: bool = False) -> dict:
    """``pytest -m gpu`` on the two boundary test files; counts from its JUnit XML."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *(["-x"] if exitfirst else []), *GPU_TEST_FILES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in counts}
        reasons = sorted({s.get("message", "") for s in suite.iter("skipped")})
    except (OSError, ET.ParseError, AttributeError):
        reasons = []
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"] + counts["errors"],
            "skipped": counts["skipped"], "skip_reasons": reasons, "exit_code": proc.returncode,
            "output_tail": proc.stdout[-1500:]}


def check_gpu_tests() -> dict:
    got = run_gpu_tests(os.path.join(OUT, "logs", "gpu_tests.xml"))
    if REHEARSE:  # no CUDA: every gpu test is selected and skipped, with the reason shown
        ok = got["passed"] == 0 and got["skipped"] > 0 and got["failed"] == 0 \
            and all("CUDA" in r for r in got["skip_reasons"])
    else:
        ok = got["passed"] > 0 and got["failed"] == 0 and got["skipped"] == 0
    return dict(got, status=status(ok))


# ---- mutants of the host copies the gpu tests must kill -----------------------------------
# (file, text, mutated text, what it removes); each text occurs once in its file
MUTANTS = (
    ("ldt/boundary/communicator.py", 'payload = payload.to("cpu", copy=True)',
     "payload = payload", "the host copy before a gloo send"),
    ("ldt/boundary/communicator.py", 'part = part.to("cpu", copy=True)', "part = part",
     "the host copy of each piece a gathering leader sends"),
    ("ldt/boundary/communicator.py",
     'landing.staged = target = torch.empty(whole_shape, dtype=dtype, device="cpu")',
     "landing.staged = target = torch.empty(whole_shape, dtype=dtype, device=self.device)",
     "the host buffer of a host-staged receive"),
    ("ldt/boundary/communicator.py",
     'device="cpu") if route.host_staged else None',
     "device=self.device) if route.host_staged else None",
     "the host buffer of a host-staged fan-out receive"),
    ("ldt/boundary/functional.py", 'payload = payload.to("cpu")', "payload = payload",
     "the host copy before a send over a caller's gloo group"),
    ("ldt/boundary/functional.py",
     'staged = target = torch.empty(tuple(shape), dtype=dtype, device="cpu")',
     "staged = target = torch.empty(tuple(shape), dtype=dtype, device=comm.device)",
     "the host buffer of a receive over a caller's gloo group"),
)


def apply_mutant(path: str, text: str, mutated: str) -> str:
    """Write the mutant; returns the original source (the caller restores it)."""
    with open(path) as f:
        source = f.read()
    if source.count(text) != 1:
        raise RuntimeError(f"{path}: the mutant's text occurs {source.count(text)} times, "
                           f"not once: {text!r} (update bench/device_checks.py MUTANTS)")
    _write_source(path, source.replace(text, mutated))
    return source


def _write_source(path: str, source: str) -> None:
    with open(path, "w") as f:
        f.write(source)
    cached = importlib.util.cache_from_source(path)
    if os.path.exists(cached):
        os.remove(cached)  # an unchanged size and second would let Python reuse the old one


def check_gpu_mutants() -> dict:
    try:
        with open(os.path.join(OUT, "logs", "gpu_tests.json")) as f:
            baseline = json.load(f)
    except (OSError, ValueError):
        baseline = {}
    if baseline.get("status") == FAIL:
        return {"status": SKIPPED, "error": "the gpu tests fail on the unchanged code"}
    rows = []
    for i, (path, text, mutated, what) in enumerate(MUTANTS):
        original = apply_mutant(path, text, mutated)
        try:
            got = run_gpu_tests(os.path.join(OUT, "logs", f"gpu_mutant_{i}.xml"),
                                exitfirst=True)
        finally:
            _write_source(path, original)
        rows.append({"mutant": f"{path}: {what}", "killed": got["failed"] > 0,
                     "passed": got["passed"], "skipped": got["skipped"]})
        save({"status": "partial", "killed": sum(r["killed"] for r in rows),
              "mutants": len(rows), "rows": rows})
    killed = sum(r["killed"] for r in rows)
    ok = killed == 0 if REHEARSE else killed == len(rows)  # rehearsal: skipped, none killed
    return {"status": status(ok), "killed": killed, "mutants": len(rows), "rows": rows}


# ---- mixed devices: ldt-train as a user runs it --------------------------------------------

def ldt_train(run_dir: str, overrides: list, timeout_s: float = 150) -> dict:
    """``python -m ldt.job.train`` and its JSON summary line (raises with the output's tail)."""
    cmd = [sys.executable, "-m", "ldt.job.train", f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mixed(gpu_stage: int, dtype: str = "float32") -> dict:
    """cpu_demo (U-shape: edge TP 1, cloud0 TP 2, cloud1 TP 1) with one TP-1 stage on the
    GPU, against the single-process reference (``train.verify``)."""
    import csv

    run_dir = fresh(os.path.join(OUT, "runs", f"mixed_stage{gpu_stage}_{dtype}"))
    over = ["cluster=cpu_demo", f"cluster.stages.{gpu_stage}.device={GPU}", "train.steps=6",
            "train.verify=true", "train.tensorboard=false", f"model.params_dtype={dtype}"]
    summary = ldt_train(run_dir, over)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    # ldt's own per-step peak of the stage: the allocator's max_memory_allocated on cuda
    peak = max(float(r[f"peak_mem_gib_stage{gpu_stage}"]) for r in rows) * 2**30
    estimate = stage_estimate(over, gpu_stage)
    parity = summary["parity_max_abs_diff"]
    fell = summary["final_loss"] < summary["first_loss"]
    bound = PARITY_FP32 if dtype == "float32" else PARITY_BF16
    return {"status": status(parity <= bound and fell), "parity_max_abs_diff": parity,
            "parity_bound": bound, "first_loss": summary["first_loss"],
            "final_loss": summary["final_loss"], "loss_fell": fell,
            "step_time_s": summary["step_time_s"], "gpu_stage": gpu_stage,
            "gpu_stage_peak_mib": peak / 2**20, "gpu_stage_estimate_mib": estimate / 2**20,
            "gpu_stage_estimate_over_peak": round(estimate / peak, 4), "overrides": over}


def stage_estimate(overrides: list, stage: int) -> int:
    """ldt-memory's estimate of one stage of a config (bytes), with the attention the stage
    runs on this machine (local layers without Transformer Engine)."""
    from omegaconf import OmegaConf

    from ldt.config import to_model
    from ldt.job.hydra import compose
    from ldt.memory import estimate
    from ldt.models.spec import TE, transformer_impl

    cfg = OmegaConf.to_container(compose(overrides), resolve=True)
    impl = transformer_impl(to_model(cfg["model"]), GPU)
    return estimate(cfg, attention="flash" if impl == TE else "local")[stage].peak


def check_mixed_edge_on_gpu() -> dict:
    return mixed(0)


def check_mixed_cloud_on_gpu() -> dict:
    return mixed(2)  # cloud1, TP 1: rank 3, the node's only GPU after three CPU ranks


def check_mixed_bf16() -> dict:
    return mixed(0, "bfloat16")


def check_memory() -> dict:
    from bench.device_runs import memory

    return memory(GPU, REHEARSE, OUT, status, environment().get("memory_gib", 80.0))


def check_speed() -> dict:
    from bench.device_runs import speed

    env = environment()
    name = env.get("device") or device_name()
    return speed(GPU, REHEARSE, OUT, status, peak_tflops(name), env.get("memory_gib", 80.0))


def main(argv=None) -> int:
    global RESULT_PATH
    name, RESULT_PATH = argv if argv is not None else sys.argv[1:]
    # the driver's timeout sends SIGTERM first: leave through the finally blocks (a mutant's
    # source is restored) before its SIGKILL
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = globals()[f"check_{name}"]()
    except Exception:
        result = {"status": FAIL, "error": traceback.format_exc()[-3000:]}
    save(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
