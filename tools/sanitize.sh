#!/usr/bin/env bash
# `make sanitize`: lmforge._core built with AddressSanitizer + UndefinedBehaviorSanitizer (any report fatal) into
# build/sanitize (the normal build and the installed extension are untouched), then, against that build:
#   1. csrc/fuzz/fuzz_text.cpp: the pre-tokenizers, the encoder and the splitter on random non-UTF-8 bytes;
#   2. tools/fuzz_core.py: random (often hostile) calls of every binding, each answered or refused with
#      ValueError/TypeError, never a memory error, each iteration on one of the decode kernels' instruction sets
#      the CPU has (scalar, AVX2, AVX-512, AVX-512 VNNI, the AVX-512 BF16 bf16-activation mode), every packed
#      weight kind;
#   3. the kernel and tokenizer tests (libasan preloaded into the uninstrumented Python; leaks not checked:
#      CPython's are not ours), on the scalar and the CPU's widest instruction set (LMFORGE_TEST_ISAS; not the
#      ones between as well: time), without the benchmark and timing tests. Not tests/test_native_fork.py: GCC 12's libasan does not hold its own
#      allocator's locks across fork(), so a child forked while another thread is inside malloc can wait forever
#      on ASan's size-class mutex (seen: 1 run in ~40, the child on a futex in the allocator's region table at
#      0x640000000000) - a hang of the sanitizer runtime, not of lmforge's locks; make test runs it on the normal build.
# About 8 minutes on 2 cores, the build included. FUZZ_ITERATIONS scales both fuzzers; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BUILD=build/sanitize
ITER=${FUZZ_ITERATIONS:-3000}
command -v cmake >/dev/null || { echo "sanitize: cmake is not on PATH (pip install cmake)"; exit 2; }
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLMFORGE_SANITIZE=address,undefined \
    -DPython_EXECUTABLE="$(realpath -s "$PY")" -DCMAKE_MAKE_PROGRAM="$(dirname "$(realpath -s "$PY")")/ninja" >/dev/null
cmake --build "$BUILD" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
CORE=$(ls "$BUILD"/_core*.so)
# libstdc++ too: the ASan runtime finds the real __cxa_throw only if libstdc++ is loaded when it starts
PRELOAD="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:print_summary=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
"$BUILD"/fuzz_text $((ITER * 100)) 1
export LMFORGE_SANITIZED_CORE=$PWD/$CORE PYTHONPATH=$PWD/tools/sanitize${PYTHONPATH:+:$PYTHONPATH}
LD_PRELOAD=$PRELOAD "$PY" tools/fuzz_core.py --iterations "$ITER" --seed 1
LMFORGE_TEST_ISAS=widest,scalar LD_PRELOAD=$PRELOAD "$PY" -m pytest -q -p no:cacheprovider \
    tests/tokenizer/test_core.py tests/tokenizer/test_core_untrusted.py tests/tokenizer/test_tokenizer.py \
    tests/generate/test_kernel_args.py tests/generate/test_decode_step.py tests/generate/test_packed_q8.py \
    tests/generate/test_bf16_activations.py \
    tests/test_native.py tests/tools/test_fuzz_core.py tests/corpus/test_sources.py \
    -k "not benchmark and not perf and not release_the_gil" "$@"
