"""`fedlase sweep --jobs N` on GPUs (fedlase/placement.py): runs go by free memory, several to a GPU where they fit,
read through a faked `torch.cuda.mem_get_info`."""
import torch

from fedlase import placement
from fedlase.config import load_config
from fedlase.placement import GpuPlan, gpu_env, gpu_need

GIB = 1 << 30


def test_free_memory_is_read_per_visible_gpu(monkeypatch):
    free = {0: 10 * GIB, 1: 4 * GIB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 16 * GIB))
    assert placement.visible_free() == [10 * GIB, 4 * GIB]


def test_runs_go_to_the_freest_gpu_several_to_one_and_wait_when_none_fits():
    plan = GpuPlan([10 * GIB, 4 * GIB])
    assert [plan.place(3 * GIB) for _ in range(3)] == [0, 0, 0]   # 10 -> 7 -> 4 left; then the tie goes to GPU 0
    assert plan.place(3 * GIB) == 1                               # GPU 0 has 1 left, GPU 1 has 4
    assert plan.place(3 * GIB) is None                            # 1 and 1 left: it waits
    plan.release(0, 3 * GIB)
    assert plan.place(3 * GIB) == 0 and plan.running == [3, 1]


def test_a_run_bigger_than_every_gpu_starts_alone_on_the_freest():
    plan = GpuPlan([2 * GIB, 5 * GIB])
    assert plan.place(8 * GIB) == 1            # nothing runs: it is let try
    assert plan.place(GIB) == 0                # the other GPU still has room for a small one
    assert plan.place(8 * GIB) is None         # but a second big one waits for the first to end
    assert GpuPlan([]).place(GIB) is None      # no GPU: nothing to place


def test_the_child_sees_only_its_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_env(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")   # the sweep's own view: index 1 is the machine's GPU 5
    assert gpu_env(1) == {"CUDA_VISIBLE_DEVICES": "5"}


def test_a_run_needs_more_with_a_bigger_model_and_batched_clients(tmp_path):
    from tools.bench import data_overrides
    base = [*data_overrides(tmp_path, n_cifar=50)["cifar"], "model=resnet18", "system={1,1/4}_{5,5}",
            "participation=0.5", "batch_size=8"]

    def need(*more):
        return gpu_need(load_config(None, [*base, *more]))
    small, full = need("width=0.25", "batched_clients=false"), need("width=1", "batched_clients=false")
    batched = need("width=1", "batched_clients=true")
    assert placement.GPU_OVERHEAD < small < full < batched
    assert need("width=1") == batched   # auto: on a GPU, batched wherever nothing rules it out
    # the dataset estimate (70,000 CIFAR-sized images: 0.8 GiB), 11.2M parameters x (5 updates + copies), a
    # batch's activations: about 2 GiB with the overhead, not tens
    assert 2 * GIB < full < 4 * GIB


def test_the_sweep_reads_the_gpus_in_a_child_and_none_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.read_free() == []


def test_a_jobs_sweep_books_its_gpus_and_waits_when_they_are_full(tmp_path, monkeypatch):
    """The sweep's loop with its children faked: each run's GPU, and no more runs at once than fit."""
    import io

    import yaml

    from fedlase import sweep

    class Child:   # a finished child process: it reported success
        def __init__(self):
            self.ticks, self.returncode, self.stdout = 3, 0, io.StringIO('{"error": null}\n')

        def poll(self):
            self.ticks -= 1
            return 0 if self.ticks <= 0 else None
    started, running, most = [], [], [0]

    def start(run, threads, gpu=None):
        started.append(gpu)
        child = Child()
        running.append(child)
        most[0] = max(most[0], sum(c.ticks > 0 for c in running))
        return child, io.StringIO()
    monkeypatch.setattr(sweep, "_start", start)
    monkeypatch.setattr(sweep, "read_free", lambda: [10 * GIB, 3 * GIB])
    monkeypatch.setattr(sweep, "gpu_need", lambda cfg: 4 * GIB)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": {"dataset": "digits", "model": "cnn", "system": "{1,1/4}_{2,2}",
                                             "rounds": 1, "device": "auto"},
                                    "out": str(tmp_path / "out"), "grid": {"seed": [0, 1, 2, 3]}}))
    res = sweep.run_sweep(path, progress=False, jobs=4)
    assert len(res["done"]) == 4
    # 10 GiB holds two runs of 4, the 3 GiB GPU none while another runs: two at once, all on GPU 0
    assert started == [0, 0, 0, 0] and most[0] == 2
