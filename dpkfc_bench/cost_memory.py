"""The cost benchmark's peak memory: every (model, method) pair in a fresh process.

One child interpreter (``python -m dpkfc_bench cost --_memory-child SPEC``) imports the
libraries once and forks a new process per pair (Linux; elsewhere one child interpreter per
pair). On CUDA the figure is ``torch.cuda.max_memory_allocated``; on CPU the peak resident set
size during the steps (``VmHWM``, reset through ``/proc/self/clear_refs`` after set-up) minus
the resident set size after model and batch construction (see :mod:`dpkfc_bench.cost`).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_bench import cost_cases as cases
from dpkfc_bench.cost_timing import setup_method, sync
from dpkfc_bench.harness import ROOT, error_text


def _proc_status_kib(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ru_maxrss_kib() -> int:
    v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return v // 1024 if sys.platform == "darwin" else v


class _MemoryProbe:
    """Peak-memory bookkeeping for one process (CUDA allocator or CPU resident set size)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = True

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _proc_status_kib("VmRSS")
        return 1024 * (rss if rss is not None else _ru_maxrss_kib())

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            trim()
            self.resettable = _reset_peak_rss() and _proc_status_kib("VmHWM") is not None

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _proc_status_kib("VmHWM") if self.resettable else None
        return 1024 * (hwm if hwm is not None else _ru_maxrss_kib())

    def method(self) -> str:
        if self.device.type == "cuda":
            return (
                "torch.cuda.max_memory_allocated: the larger of the set-up peak (first refresh "
                "included) and the steps' peak (reset after set-up)"
            )
        if self.resettable:
            return (
                "peak RSS during the steps (VmHWM, reset via /proc/self/clear_refs after "
                "set-up) minus RSS after model and batch construction, in a process warmed up "
                "by one set-up and step of the same method on a throwaway copy; the larger of "
                "this and the set-up's peak (which includes the first preconditioner refresh)"
            )
        return "getrusage ru_maxrss (process lifetime peak; upper bound) minus RSS baseline"


def measure_memory_job(job: dict[str, Any]) -> dict[str, Any]:
    """Peak memory of one (model, method) in the current process (call it in a fresh one)."""
    torch.set_num_threads(int(job["threads"]))
    device = torch.device(job["device"])
    case = cases.CASES[job["model"]]
    shape = tuple(job["shape"])
    kfc = dict(job.get("kfc") or {})
    mem = _MemoryProbe(device)
    seed = job["seed"]

    def model_and_batch() -> tuple[nn.Module, Tensor, Tensor]:
        model, _ = cases.build_network(case, seed, shape)
        x, y = cases.make_batch(case, job["batch"], shape, seed)
        return model.to(device), x.to(device), y.to(device)

    # Warm-up on a throwaway copy: one set-up and step of the same method, then freed, so that
    # one-time library initialisation (BLAS/LAPACK workspaces, FFT plans, oneDNN primitives)
    # is not charged to any method; the measured set-up and steps below start warm.
    precision = job.get("precision", "float32")
    warm = setup_method(job["method"], case, *model_and_batch(), shape, seed, kfc, precision)
    warm.step()
    warm.release()
    del warm
    gc.collect()
    model, x, y = model_and_batch()
    sync(device)
    trim()
    baseline = mem.current()
    mem.reset()
    runner = setup_method(job["method"], case, model, x, y, shape, seed, kfc, precision)
    sync(device)
    setup_peak = mem.peak()
    trim()
    after_setup = mem.current()
    mem.reset()
    for _ in range(int(job["steps"])):
        runner.step()
    sync(device)
    peak = mem.peak()
    mib = 1024.0**2
    return {
        "model": case.key,
        "method": job["method"],
        "batch": job["batch"],
        "steps": job["steps"],
        "kfc": kfc if job["method"].startswith("dp-kfc") else None,
        "baseline_mib": baseline / mib,
        "setup_peak_increase_mib": (setup_peak - baseline) / mib,
        "after_setup_increase_mib": (after_setup - baseline) / mib,
        "step_peak_mib": peak / mib,
        "step_peak_increase_mib": (peak - baseline) / mib,
        # Training peak = the larger of the steps' peak and the set-up's (which includes the
        # first preconditioner refresh; refreshes recur during training). On the CPU the RSS
        # can end below the baseline when the allocator returns freed pages: no increase, 0.
        "primary_mib": max(
            peak if device.type == "cuda" else peak - baseline,
            setup_peak if device.type == "cuda" else setup_peak - baseline,
            0,
        )
        / mib,
        "how": mem.method(),
    }


def _run_jobs_forked(jobs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Run each job in a process forked from this (import-only) interpreter."""
    results = []
    for job in jobs:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: measure, report through the pipe, exit without cleanup
            os.close(r)
            code = 0
            try:
                payload = measure_memory_job(job)
            except BaseException as exc:  # noqa: BLE001 - report any failure to the parent
                payload = {**job, "error": error_text(exc)}
                code = 1
            with os.fdopen(w, "w") as f:
                json.dump(payload, f)
            os._exit(code)
        os.close(w)
        # The payload is far below the pipe buffer, so the child never blocks on writing.
        deadline = time.monotonic() + timeout_s
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        with os.fdopen(r) as f:
            text = f.read()
        try:
            results.append(json.loads(text))
        except json.JSONDecodeError:
            results.append({**job, "error": "timeout or crash (killed by a signal?)"})
    return results


def memory_child_main(spec_json: str) -> None:
    """Entry of ``--_memory-child``: run the jobs, print one JSON list on stdout."""
    spec = json.loads(spec_json)
    jobs = spec["jobs"]
    if hasattr(os, "fork") and len(jobs) > 1:
        import opacus  # noqa: F401 - import once, before forking

        import dpkfc_med.models  # noqa: F401
        import dpkfc_med.privacy.engine  # noqa: F401
        import dpkfc_med.probes  # noqa: F401

        results = _run_jobs_forked(jobs, float(spec.get("job_timeout_s", 1800)))
    else:
        results = []
        for job in jobs:
            try:
                results.append(measure_memory_job(job))
            except Exception as exc:  # noqa: BLE001
                results.append({**job, "error": error_text(exc)})
    print("@@MEMORY@@" + json.dumps(results))


def measure_memory(
    jobs: list[dict[str, Any]], timeout_s: float, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Run memory jobs in a child interpreter (fork per job); one child per job off Linux."""
    groups = [jobs] if hasattr(os, "fork") else [[j] for j in jobs]
    out: list[dict[str, Any]] = []
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    for group in groups:
        spec = json.dumps({"jobs": group, "job_timeout_s": timeout_s})
        cmd = [sys.executable, "-m", "dpkfc_bench", "cost", "--_memory-child", spec]
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
                timeout=timeout_s * len(group) + 120,
            )
        except subprocess.TimeoutExpired:
            out += [{**j, "error": "memory child timed out"} for j in group]
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@MEMORY@@")), None)
        if line is None:
            tail = proc.stderr.strip().splitlines()[-3:]
            out += [{**j, "error": f"memory child failed: {' | '.join(tail)}"} for j in group]
            continue
        out += json.loads(line[len("@@MEMORY@@") :])
    for r in out:
        if "error" in r:
            log(f"  memory {r['model']}/{r['method']}: ERROR {r['error']}")
        else:
            log(f"  memory {r['model']}/{r['method']}: {r['primary_mib']:.1f} MiB")
    return out
