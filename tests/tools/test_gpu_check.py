"""tools/gpu_check.sh: the GPU check's dry run end to end at its smallest (``--quick``: every stage on the CPU at
tiny shapes, a step or two each: the JSON, the tables, the exit code; the full-size dry run is ``make
gpu-check-dry``), its refusals (no CUDA device, no bf16, a dependency with no wheel: one line, exit 2), the
install plan, the time caps that keep partial results, and the targets read from the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402
from gpu_report import summary, targets  # noqa: E402


def _quick(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--quick", "--out", str(out), "--work",
                        str(tmp_path / "work"), *args], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable), timeout=580)
    return r, json.loads((out / "gpu_check.json").read_text())


def test_quick_dry_run_of_the_inference_stages(tmp_path: Path) -> None:
    """In `make test`: the probe, generation (lmforge vs HF, same tokens first) and serving stages end to end on
    the CPU, each in its own process; the whole check's dry run is `make gpu-check-dry` (~140 CPU-seconds)."""
    r, doc = _quick(tmp_path, "--only", "probe,generate,serve")
    stages = doc["stages"]
    assert r.returncode == 0, (r.stdout[-3000:], {k: v["status"] for k, v in stages.items()})
    assert [k for k, v in stages.items() if v["status"] == "ok"] == ["probe", "generate", "serve"]
    assert stages["probe"]["records"][0]["peak_flops"] > 0
    gen = stages["generate"]["records"]
    assert gen[0]["kind"] == "same_work" and gen[0]["ok"]
    serve = stages["serve"]["records"][0]
    assert serve["clients"] == 2 and serve["ratio"] > 0 and serve["texts_equal_hf"] == "1/1"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("LMFORGE_GPU_DRY_RUN") != "1",
                    reason="the whole check's dry run (~140 CPU-seconds): set LMFORGE_GPU_DRY_RUN=1 "
                           "(make gpu-check-dry runs it)")
def test_quick_dry_run_runs_every_stage_and_writes_every_figure(tmp_path: Path) -> None:
    """Each stage in its own process as on the GPU machine: ~15 interpreters that import torch, lmforge and HF
    (2-7 CPU-seconds each) are most of its ~140 CPU-seconds (each stage's cpu_s is in the JSON), not the steps."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--quick", "--out", str(out), "--work",
                        str(tmp_path / "work")], capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable),
                       timeout=580)
    doc = json.loads((out / "gpu_check.json").read_text())
    stages = doc["stages"]
    assert r.returncode == 0, (r.stdout[-3000:], {k: v["status"] for k, v in stages.items()})
    assert doc["dry_run"] and doc["quick"]
    assert list(stages) == ["probe", "tests", "train-gpt2", "profile", "train-d20", "resume", "generate", "serve",
                            "loop", "speedrun"]
    assert all(s["status"] == "ok" and s["cpu_s"] > 0 for s in stages.values())

    def kinds(stage: str) -> list[dict]:
        return stages[stage]["records"]

    assert kinds("probe")[0]["peak_flops"] > 0 and kinds("tests")[0]["rc"] == 0
    assert kinds("tests")[0]["skipped"] >= 10  # the GPU tests collect (as a file alone) and skip on a CPU
    same, *runs, trained = kinds("train-gpt2")
    assert same["kind"] == "same_work" and same["ok"] and abs(same["loss_lmforge"] - same["loss_hf"]) < 2e-2
    assert trained["kind"] == "same_training" and trained["ok"] and len(trained["last_losses"]) == 4
    assert [(x["impl"], x["compile"]) for x in runs] == [("lmforge", "eager"), ("hf", "eager"), ("lmforge", "compiled"),
                                                         ("hf", "compiled")]
    assert "torch.compile(whole model)" in runs[3]["config"] and not any(x["weaker_variant"] for x in runs)
    assert all(x["tokens_per_s"] > 0 and 0 < x["mfu"] for x in runs)
    assert [(x["kind"], x.get("impl")) for x in kinds("train-d20")] == [("same_work", None), ("train", "lmforge"),
                                                                        ("same_training", None)]
    prof = kinds("profile")[0]
    assert prof["ms_per_step"] > 0 and prof["top"] and abs(sum(prof["shares"].values()) - 1) < 1e-6
    assert prof["shares"].get("gemm", 0) > 0
    assert runs[0]["first_step_loss"] == pytest.approx(runs[1]["first_step_loss"], abs=2e-2)
    res = kinds("resume")[0]
    assert res["bitwise"] and res["killed_after_step"] > res["checkpoint_step"] == 4  # killed mid-run, resumed
    assert res["steps"] == 8
    gen = kinds("generate")
    assert gen[0]["kind"] == "same_work" and gen[0]["ok"]
    assert {(x["batch"], x["impl"]) for x in gen[1:]} == {(b, i) for b in (1, 2)
                                                         for i in ("lmforge", "lmforge_no_graphs", "lmforge_compiled",
                                                                   "hf_dynamic", "hf_static_compiled")}
    serve = kinds("serve")[0]
    assert serve["clients"] == 2 and serve["ratio"] > 0 and serve["texts_equal_hf"] == "1/1"
    assert kinds("loop")[0]["steps"] == 6 and kinds("speedrun")[0]["val_loss"] > 0
    assert set(doc["targets"]) == {"mfu_gpt2", "mfu_d20", "train_vs_hf", "generate_b1_vs_hf", "serve_vs_hf"}
    assert all(t["got"] is not None for t in doc["targets"].values())
    text = (out / "summary.md").read_text()
    for heading in ("| stage | status", "### bf16 training", "### one compiled training step", "### greedy generation",
                    "### serving", "### targets"):
        assert heading in text
    assert text.strip() in r.stdout and (out / "gpu_check.log").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_check_refuses_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--out", str(tmp_path)], capture_output=True,
                       text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "no CUDA device" in r.stderr and "--dry-run" in r.stderr


def test_refusals_name_the_reason_and_the_way_out() -> None:
    assert gpu_check.refusal({"cuda": True, "bf16": True, "name": "NVIDIA H100 80GB HBM3"}) is None
    assert "--dry-run" in gpu_check.refusal({"cuda": False, "torch": "2.11.0"})
    line = gpu_check.refusal({"cuda": True, "bf16": False, "name": "Tesla T4", "capability": [7, 5]})
    assert "Tesla T4 (compute capability 7.5) has no bf16" in line and ">= 8.0" in line


def test_install_plan_takes_only_the_missing_wheels_and_names_what_none_provides(tmp_path: Path) -> None:
    for name in ("platformdirs-4.3.6-py3-none-any.whl", "pydantic_core-2.33.2-cp312-cp312-manylinux_2_17_x86_64.whl",
                 "numpy-2.0.0-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    wheels = gpu_check.wheel_files(tmp_path)
    assert set(wheels) == {"platformdirs", "pydantic-core", "numpy"}
    todo, missing = gpu_check.plan_install(["numpy", "platformdirs", "zstandard", "torch"], {"numpy", "torch"}, wheels)
    assert [p.name.split("-")[0] for p in todo] == ["platformdirs", "pydantic_core"] and missing == ["zstandard"]
    need = gpu_check.required_dists()
    assert {"platformdirs", "matplotlib", "torch", "fastapi", "uvicorn", "transformers"} <= set(need)
    cmd = gpu_check.download_command(tmp_path, ["platformdirs==4.3.6"], python="py")
    assert cmd[:4] == ["py", "-m", "pip", "download"] and "--only-binary=:all:" in cmd and "3.12" in cmd
    assert "manylinux2014_x86_64" in cmd and cmd[-1] == "platformdirs==4.3.6"


def test_prepare_downloads_what_the_light_dependencies_need_too() -> None:
    """A bare image lacked fastapi's own dependency (opentelemetry-api, first H100 run): --prepare takes the closure
    of what is installed here, extras left out."""
    have = gpu_check.dependency_closure(["fastapi"])
    assert {"fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types"} <= set(have)
    assert all(v for v in have.values())
    assert "email-validator" not in have and "jinja2" not in have  # fastapi[all]'s, not fastapi's
    assert set(gpu_check.PREPARE_PACKAGES) <= {gpu_check.norm(n) for n in gpu_check.dependency_closure(
        gpu_check.PREPARE_PACKAGES)}


def test_a_dependency_without_a_wheel_is_named_with_the_prepare_command(tmp_path, monkeypatch, capsys) -> None:
    gpu = {"torch": "2.11.0", "cuda": True, "bf16": True, "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
    monkeypatch.setattr(gpu_check, "_python_json", lambda code, env: gpu if code == gpu_check._DEVICE else ["torch"])
    monkeypatch.setattr(gpu_check, "required_dists", lambda: ["torch", "zstandard"])
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path / "none")
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "lmforge needs zstandard" in err and "tools/gpu_check.sh --prepare" in err


def test_a_stage_cut_at_its_cap_keeps_what_it_wrote(tmp_path: Path, monkeypatch) -> None:
    """A child killed at its cap (with whatever it started) leaves its JSON lines; a failing child, or one that
    reports ``ok: false``, fails the stage; the JSON document is rewritten after every stage."""
    monkeypatch.setattr(gpu_check, "MIN_STAGE_S", 0.0)
    monkeypatch.setattr(gpu_check, "RESERVE_S", 0.0)
    c = gpu_check.Check(gpu_check.argparse.Namespace(out=str(tmp_path / "out"), work=str(tmp_path), budget=60,
                                                     dry_run=False))
    write = "import json, sys, time; open(sys.argv[-1], 'a').write(json.dumps({'kind': 'x', 'ok': %s}) + '\\n'); %s"
    slow = [sys.executable, "-c", "import json, subprocess, sys, time; s = subprocess.Popen(['sleep', '60']); "
            "open(sys.argv[-1], 'a').write(json.dumps({'kind': 'x', 'ok': True, 'pid': s.pid}) + '\\n'); time.sleep(60)"]
    (got,) = c.stage("slow", slow, cap=3)
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["stages"]["slow"]["records"] == [got]
    time.sleep(0.5)
    status = Path(f"/proc/{got['pid']}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()  # what the child started went with it
    assert c.stage("bad", [sys.executable, "-c", write % ("False", "")], cap=30) == [{"kind": "x", "ok": False}]
    assert c.stage("crash", [sys.executable, "-c", write % ("True", "sys.exit(3)")], cap=30)
    assert c.stage("optional", [sys.executable, "-c", "import time; time.sleep(60)"], cap=1, optional=True) == []
    c.deadline = 0.0
    assert c.stage("late", [sys.executable, "-c", "pass"], cap=30) == []
    assert c.stage("late-optional", [sys.executable, "-c", "pass"], cap=30, optional=True) == []
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert {k: v["status"] for k, v in doc["stages"].items()} == {
        "slow": "timeout", "bad": "failed", "crash": "failed", "optional": "cut", "late": "no time",
        "late-optional": "skipped"}
    assert 2.5 < doc["stages"]["slow"]["seconds"] < 20


def test_corpus_slices_are_many_documents_so_every_split_gets_some(tmp_path: Path) -> None:
    """Shakespeare has 41 works: a 2 MB slice of whole works could leave the validation split empty (the speedrun
    and the loop would fail on the GPU machine), so the check cuts its slices into ~10 kB documents at line ends."""
    from gpu_train import corpus_slice

    work = "".join(f"line {i} of a long work\n" for i in range(5000))  # ~120 kB, one document
    text = "<E>".join([work, work, work])
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    docs = corpus_slice(str(tmp_path / "c.txt"), 300_000, "<E>").split("<E>")
    assert len(docs) >= 25 and all(d.endswith("\n") for d in docs[:-1]) and max(map(len, docs)) < 10_100
    assert "".join(docs) == text[:300_000].replace("<E>", "\n")  # nothing lost, nothing added
    assert len(corpus_slice(None, 50_000, "<E>").split("<E>")) > 10


def test_targets_and_summary_read_the_figures() -> None:
    def rec(impl, mfu, tps, mode="eager"):
        return {"kind": "train", "shape": "gpt2", "impl": impl, "compile": mode, "batch": 32, "context": 1024,
                "tokens_per_s": tps, "step_ms": 1.0, "mfu": mfu, "mfu_datasheet": None, "peak_mem_gib": 20.0,
                "warmup_s": 1.0, "first_step_loss": 10.8}

    doc = {"device": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}, "started": "now", "elapsed_s": 400,
           "budget_s": 470, "stages": {
               "train-gpt2": {"status": "ok", "seconds": 60, "cap_s": 120, "records": [
                   rec("lmforge", 0.40, 400e3), rec("lmforge", 0.47, 470e3, "compiled"), rec("hf", 0.30, 300e3)]},
               "generate": {"status": "ok", "seconds": 30, "cap_s": 100, "records": [
                   {"kind": "generate", "impl": i, "batch": 1, "tokens_per_s": t, "warmup_s": 1.0,
                    "bf16_tokens_equal_hf": 1.0} for i, t in (("lmforge", 300.0), ("hf_dynamic", 50.0),
                                                              ("hf_static_compiled", 200.0))]},
               "serve": {"status": "timeout", "seconds": 70, "cap_s": 70, "records": [], "note": "killed"}}}
    t = targets(doc)
    assert t["mfu_gpt2"] == {"what": t["mfu_gpt2"]["what"], "want": 0.45, "got": 0.47, "met": True}
    assert t["train_vs_hf"]["got"] == pytest.approx(470 / 300) and t["train_vs_hf"]["met"]
    assert t["generate_b1_vs_hf"]["got"] == pytest.approx(1.5) and t["generate_b1_vs_hf"]["met"] is False
    assert t["mfu_d20"]["got"] is None and t["serve_vs_hf"]["met"] is None  # not measured: neither met nor missed
    text = summary(doc)
    assert "| gpt2 | lmforge | compiled | - | 32 x 1024 | 470,000 |" in text and "| serve | timeout | 70 (70) | killed |" in text
    assert "| bf16 MFU against the measured peak, GPT-2 small shape (lmforge, best mode) | 45% | 47.0% | yes |" in text


def test_runs_that_train_apart_from_the_same_start_fail_the_stage(tmp_path: Path, monkeypatch) -> None:
    """The first losses agreed on the H100 while a compiled run's gradients were wrong (torch 2.11): the stage now
    also compares the runs' last losses after the same steps, and a spread past the tolerance is a failure."""
    import argparse

    import gpu_train

    last = iter([5.75, 5.75, 5.50])  # the third run trains elsewhere
    monkeypatch.setattr(gpu_train, "_time_run", lambda *a, **k: {
        "tokens_per_s": 1.0, "step_ms": 1.0, "warmup_s": 0.0, "peak_mem_gib": None, "first_step_loss": 5.77,
        "last_loss": next(last)})
    result = tmp_path / "r.jsonl"
    a = argparse.Namespace(dry_run=True, quick=True, shape="tiny", runs="lmforge:eager,hf:eager,lmforge:compiled",
                           peak=None, datasheet=None, result=str(result))
    gpu_train.train(a)
    recs = [json.loads(x) for x in result.read_text().splitlines()]
    same = [r for r in recs if r["kind"] == "same_training"]
    assert len(same) == 1 and same[0]["ok"] is False and same[0]["spread"] == pytest.approx(0.25)
    assert same[0]["last_losses"] == {"lmforge:eager": 5.75, "hf:eager": 5.75, "lmforge:compiled": 5.5}


def test_profiled_kernels_are_classified_by_name() -> None:
    import gpu_train

    assert gpu_train.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert gpu_train.kind_of("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert gpu_train.kind_of("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert gpu_train.kind_of("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert gpu_train.kind_of("triton_per_fused__to_copy_mul_rsqrt_0") == "compiled (triton / inductor)"
    assert gpu_train.kind_of("void at::native::(anonymous)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert gpu_train.kind_of("void at::native::elementwise_kernel<128, 2>") == "other"


def test_profile_counts_each_device_kernel_once() -> None:
    """The profiler lists an op (``aten::mm``, its own device time = the kernels it launched) and each kernel; the
    H100 run of 2026-11-27 summed both and reported 148 ms for a 76 ms step."""
    import gpu_train
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    op = FunctionEvent(0, "aten::mm", 1, 0, 50, use_device="cuda", stack=[])  # the CPU-side op: 50 us on the host
    op.append_kernel("nvjet_gemm", 0, 3000)  # it launched a 3 ms kernel
    kernel = FunctionEvent(1, "nvjet_gemm", 2, 10, 3010, use_device="cuda", stack=[], device_type=DeviceType.CUDA)
    softmax = FunctionEvent(2, "triton_red_fused_softmax", 2, 3020, 4020, use_device="cuda", stack=[],
                            device_type=DeviceType.CUDA)
    events = EventList([op, kernel, softmax], use_device="cuda")
    events._build_tree()
    averages = events.key_averages()
    assert sum(e.self_device_time_total for e in averages) == 7000  # what the old sum counted: the gemm twice
    rows = gpu_train.timed_rows(averages, steps=2, on_device=True)
    assert sorted(rows) == [("nvjet_gemm", 1.5, 0), ("triton_red_fused_softmax", 0.5, 0)]
    cpu_rows = gpu_train.timed_rows(averages, steps=1, on_device=False)  # on the CPU: each op's own host time
    assert ("aten::mm", 0.05, 1) in cpu_rows


def test_a_test_run_cut_at_its_cap_still_names_the_tests_that_failed(tmp_path: Path, monkeypatch) -> None:
    """The suite stage (optional, the time left) killed mid-run: the failure before the cut is named in the JSON and
    the summary, and fails the stage (the H100 run of 2026-11-27 showed one ``F`` and never said which test)."""
    monkeypatch.setattr(gpu_check, "MIN_STAGE_S", 0.0)
    monkeypatch.setattr(gpu_check, "RESERVE_S", 0.0)
    tests = tmp_path / "test_cut.py"
    tests.write_text("import time\n\ndef test_a_fails():\n    assert 1 + 1 == 3, 'wrong sum'\n\n"
                     "def test_b_hangs():\n    time.sleep(120)\n")
    c = gpu_check.Check(gpu_check.argparse.Namespace(out=str(tmp_path / "out"), work=str(tmp_path / "w"), budget=120,
                                                     dry_run=False))
    argv = [sys.executable, str(ROOT / "tools/gpu_run.py"), "pytest", "-q", "-p", "no:cacheprovider", "-o",
            "addopts=", "--rootdir", str(tmp_path), str(tests)]
    records = c.stage("suite", argv, cap=6, optional=True)
    (fail,) = [r for r in records if r["kind"] == "pytest_failure"]
    assert fail["test"].startswith("test_cut.py::test_a_fails (call)") and "wrong sum" in fail["test"]
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert doc["stages"]["suite"]["status"] == "failed"
    assert "| suite | failed |" in summary(doc) and "failed: test_cut.py::test_a_fails" in summary(doc)


def test_hf_is_compiled_whole_with_its_fastest_optimizer_and_every_run_names_its_configuration(
        tmp_path: Path, monkeypatch) -> None:
    """The HF baseline is what an HF user runs: ``torch.compile`` of the whole model (head and loss included), fused
    AdamW on CUDA (foreach on the CPU, labelled), bf16 autocast; the per-layer compile only as a labelled weaker
    variant. A tiny dry run on the CPU: each run trains, and its record and the report name its configuration."""
    import argparse

    import gpu_train
    from torch._dynamo.eval_frame import OptimizedModule

    from lmforge.train import distributed

    monkeypatch.setattr(distributed, "_COMPILE_OPTIONS", {"backend": "eager"})  # dynamo's trace alone: seconds
    monkeypatch.setattr(gpu_train, "_dry_compile", lambda a: None)
    cfg = gpu_train._model_config("tiny")
    state = gpu_train._hf_init(cfg, torch.device("cpu"))
    model, opt, _ = gpu_train._build("hf", cfg, state, torch.device("cpu"), "compiled")
    assert isinstance(model, OptimizedModule) and type(model._orig_mod).__name__ == "LlamaForCausalLM"
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
    layers, _, _ = gpu_train._build("hf", cfg, state, torch.device("cpu"), "compiled_layers")
    assert not isinstance(layers, OptimizedModule) and ("hf", "compiled_layers") in gpu_train.WEAKER
    with pytest.raises(ValueError, match="hf:compiled_layers"):
        gpu_train._build("hf", cfg, state, torch.device("cpu"), "fast")
    assert "fused=True" in gpu_train.run_config("hf", "compiled", "cuda")
    assert "torch.compile(whole model)" in gpu_train.run_config("hf", "compiled", "cuda")

    result = tmp_path / "r.jsonl"
    a = argparse.Namespace(dry_run=True, quick=True, shape="tiny", runs="hf:eager,hf:compiled",
                           peak=1e12, datasheet=2e12, result=str(result))
    gpu_train.train(a)
    recs = [json.loads(x) for x in result.read_text().splitlines()]
    runs = [r for r in recs if r["kind"] == "train"]
    assert [(r["compile"], r["weaker_variant"]) for r in runs] == [("eager", False), ("compiled", False)]
    assert "torch.compile(whole model)" in runs[1]["config"] and "foreach" in runs[1]["config"]
    assert "fused is CUDA-only" in runs[1]["config"] and "WEAKER" not in runs[1]["config"]
    assert gpu_train.run_config("hf", "compiled_layers", "cuda").count("WEAKER VARIANT") == 1
    assert all(r["mfu_datasheet"] == pytest.approx(r["mfu"] / 2) for r in runs)
    assert [r for r in recs if r["kind"] == "same_training"][0]["ok"]
    doc = {"device": {}, "stages": {"train-gpt2": {"status": "ok", "seconds": 1, "cap_s": 1, "records": recs}}}
    text = summary(doc)
    assert "MFU (measured peak) | MFU (datasheet)" in text and f"| {runs[1]['config']} |" in text
    with pytest.raises(SystemExit, match="unknown training run"):
        gpu_train.train(argparse.Namespace(**{**vars(a), "runs": "hf:turbo"}))
