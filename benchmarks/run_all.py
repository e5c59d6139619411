"""Run every benchmark script in this folder, one after another, and print their tables.

    python benchmarks/run_all.py            # full runs (tens of minutes on 2 CPU cores; keep the machine quiet)
    python benchmarks/run_all.py --quick    # smoke run of each script (seconds each)
    python benchmarks/run_all.py --only tokenizer_train tokenizer_encode

Each script runs lmforge and its peer side by side in one process tree and prints the ratio; this runner
only sequences them so that no two benchmarks compete for the cores. The training-step and generation benchmarks
run twice: at their default shape and at the second shape near GPT-2 small (``--shape gpt2s``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Scripts run more than once: the benchmark shape (the script's defaults), then the second shape near GPT-2 small.
VARIANTS = {
    "bench_train_step.py": [[], ["--shape", "gpt2s", "--steps", "6", "--warmup", "1"]],
    "bench_generate.py": [[], ["--shape", "gpt2s"]],
    "bench_llamacpp.py": [[], ["--shape", "gpt2s"]],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every script (smoke run)")
    ap.add_argument("--only", nargs="*", default=None, help="names without the bench_ prefix, e.g. tokenizer_train")
    args = ap.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        wanted = {f"bench_{n.removeprefix('bench_').removesuffix('.py')}.py" for n in args.only}
        unknown = wanted - {s.name for s in scripts}
        if unknown:
            print(f"run_all: unknown benchmark(s) {sorted(unknown)}; have {[s.stem[6:] for s in scripts]}",
                  file=sys.stderr)
            return 2
        scripts = [s for s in scripts if s.name in wanted]
    failed = []
    for script in scripts:
        for extra in ([[]] if args.quick else VARIANTS.get(script.name, [[]])):
            cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else extra)
            name = " ".join([script.name] + extra)
            print(f"\n## {name}\n", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.call(cmd)
            print(f"\n({name}: exit {rc}, {time.perf_counter() - t0:.0f} s)", flush=True)
            if rc != 0:
                failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
