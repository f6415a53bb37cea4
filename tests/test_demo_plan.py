"""What `pipeline demo` runs, planned from the doctor's facts, for the three kinds of machine."""

from __future__ import annotations

from pipeline.demo.plan import Run, format_plan, plan_demo
from pipeline.environment import CpuFacts, Facts, Gpu, OrtFacts, TorchFacts, TrtFacts

CPU_EPS = ("CPUExecutionProvider",)
GPU_EPS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
H100 = Gpu(0, "NVIDIA H100 80GB HBM3", 79.1, "9.0")


def facts(torch_info: TorchFacts, ort: OrtFacts, trt: TrtFacts) -> Facts:
    return Facts("3.11.7", "Linux", torch_info, ort, trt,
                 {"sentencepiece": "0.2.0", "sacrebleu": "2.4.0", "ctranslate2": "not installed"},
                 CpuFacts("Xeon", 16, {"AVX2": True}))


def test_cpu_only_machine_runs_the_demo_as_always():
    plan = plan_demo(facts(TorchFacts("2.13.0+cpu", no_gpu_reason="this PyTorch is a CPU-only build"),
                           OrtFacts("1.31.1", CPU_EPS),
                           TrtFacts(None, reason="tensorrt is not installed (pip install ...)")))
    assert (plan.device, plan.train_precision, plan.export_tensorrt) == ("cpu", "fp32", None)
    assert plan.backends("fp32") == plan.backends("fp16") == ["torch", "onnxruntime"]
    assert Run("onnxruntime", "fp16", "cpu") in plan.runs
    assert plan.skipped == (("tensorrt", "tensorrt is not installed (pip install ...)"),)
    assert plan.gpu_memory_gib is None
    assert format_plan(plan) == ["device: cpu; training precision fp32",
                                 "not run: tensorrt: tensorrt is not installed (pip install ...)"]


def test_cuda_without_tensorrt_and_cpu_onnxruntime():
    gpu = TorchFacts("2.13.0+cu130", "13.0", 91000, (H100,), bf16=True, nccl=True)
    plan = plan_demo(facts(gpu, OrtFacts("1.31.1", CPU_EPS), TrtFacts(None, reason="tensorrt is not installed")))
    assert (plan.device, plan.train_precision, plan.export_tensorrt) == ("cuda", "bf16", None)
    assert plan.backends("fp16") == ["torch"]
    reasons = dict(plan.skipped)
    assert "no CUDAExecutionProvider" in reasons["onnxruntime"] and "onnxruntime-gpu" in reasons["onnxruntime"]
    assert reasons["tensorrt"] == "tensorrt is not installed"
    assert format_plan(plan)[0] == "device: cuda; training precision bf16; GPU memory 79.1 GiB"


def test_cuda_with_tensorrt_and_onnxruntime_gpu_runs_everything_on_the_gpu():
    gpu = TorchFacts("2.13.0+cu130", "13.0", 91000, (H100,), bf16=True, nccl=True)
    plan = plan_demo(facts(gpu, OrtFacts("1.31.1", GPU_EPS), TrtFacts("10.13.0.35", usable=True)))
    assert (plan.device, plan.train_precision, plan.export_tensorrt) == ("cuda", "bf16", True)
    assert plan.skipped == ()
    for precision in ("fp32", "fp16"):
        assert plan.backends(precision) == ["torch", "onnxruntime", "tensorrt"]
        assert Run("tensorrt", precision, "cuda") in plan.runs
        assert Run("onnxruntime", precision, "cuda") in plan.runs
        assert Run("torch", precision, "cpu") in plan.runs  # parity's reference: fp32 on the CPU

    # a GPU without bf16 trains with fp16 autocast; the user's --backends narrows the runs
    old = TorchFacts("2.13.0+cu130", "13.0", 91000, (Gpu(0, "Tesla V100", 15.8, "7.0"),), bf16=False)
    plan = plan_demo(facts(old, OrtFacts("1.31.1", GPU_EPS), TrtFacts("10.13.0.35", usable=True)),
                     wanted=("torch", "tensorrt"))
    assert plan.train_precision == "fp16" and plan.backends("fp32") == ["torch", "tensorrt"]


def test_asked_for_tensorrt_without_it_is_listed_not_dropped():
    plan = plan_demo(facts(TorchFacts("2.13.0+cpu", no_gpu_reason="CPU-only build"), OrtFacts("1.31.1", CPU_EPS),
                           TrtFacts(None, reason="tensorrt is not installed")), wanted=("torch", "tensorrt"))
    assert plan.backends("fp32") == ["torch"]
    assert plan.skipped == (("tensorrt", "tensorrt is not installed"),)
