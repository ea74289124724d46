"""What a local Ray instance is told of GPUs, and how CUDA workers fit on them (`cluster.serve.gpus`),
with the node's GPU count mocked: no GPU is needed."""

from __future__ import annotations

import pytest

import cluster.serve.gpus as gpus
from cluster.serve import launch
from cluster.serve.config_load import load_serve_config
from cluster.serve.gpus import GPUPlacementError, gpu_demand, node_gpu_count, share_gpus


def cuda_config(**overrides):
    return load_serve_config(overrides={"engine.device": "cuda", **overrides})


@pytest.mark.parametrize("visible, count", [("0", 1), ("0,1,3", 3), ("", 0), ("-1", 0), ("2,-1,3", 1),
                                            ("GPU-6f1c, GPU-77aa", 2)])
def test_visible_devices_decide_the_count(monkeypatch, visible, count):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert node_gpu_count() == count


def test_without_visible_devices_the_driver_entries_are_counted(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "NVIDIA_GPUS_DIR", tmp_path / "gpus")
    assert node_gpu_count() == 0  # no driver
    (tmp_path / "gpus").mkdir()
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (tmp_path / "gpus" / bus).mkdir()
    assert node_gpu_count() == 2


def test_one_gpu_is_shared_by_prefill_and_decode():
    """The default CUDA cluster (one prefill, one decode, a whole GPU each) on a one-GPU node: half
    each, 1 GPU asked of Ray; the configuration is otherwise untouched."""
    config = cuda_config()
    assert gpu_demand(config) == 2.0
    shared = share_gpus(config, 1)
    assert (shared.prefill.num_gpus, shared.decode.num_gpus) == (0.5, 0.5) and gpu_demand(shared) == 1.0
    assert shared.prefill.engine == config.prefill.engine and shared.decode.count == config.decode.count


@pytest.mark.parametrize("node_gpus, counts, each", [(8, (1, 1), 1.0), (2, (1, 1), 1.0), (2, (2, 1), 0.5),
                                                     (1, (2, 2), 0.25), (3, (4, 4), 1 / 3)])
def test_whole_gpu_workers_share_evenly_when_there_are_fewer_gpus(node_gpus, counts, each):
    config = cuda_config(**{"prefill.count": counts[0], "decode.count": counts[1]})
    fitted = share_gpus(config, node_gpus)
    assert fitted.prefill.num_gpus == fitted.decode.num_gpus == pytest.approx(each)
    assert gpu_demand(fitted) <= node_gpus
    assert (fitted is config) == (each == 1.0)


def test_what_cannot_be_shared_is_refused_with_the_numbers():
    with pytest.raises(GPUPlacementError, match=r"ask for 1\.5 GPUs \(prefill: 1 x 0\.75, decode: 1 x 0\.75\) "
                                                r"and this node has 1"):
        share_gpus(cuda_config(**{"prefill.num_gpus": 0.75, "decode.num_gpus": 0.75}), 1)
    with pytest.raises(GPUPlacementError, match=r"2 worker\(s\) run on engine.device cuda \(prefill, decode\) but "
                                                r"this node has no GPU"):
        share_gpus(cuda_config(), 0)
    cpu = load_serve_config()
    assert share_gpus(cpu, 0) is cpu  # nothing on CUDA: nothing to fit


def test_a_worker_over_ranks_asks_a_gpu_a_rank_and_is_not_packed_onto_fewer():
    """`-tp 2` on CUDA: each worker asks Ray for 2 GPUs (one bundle, one node; the ranks see the two
    Ray hands it as cuda:0 and cuda:1); 4 GPUs hold prefill and decode, 2 do not, with the way out."""
    config = cuda_config(**{"engine.tensor_parallel_size": 2})
    assert (config.prefill.num_gpus, config.decode.num_gpus) == (2.0, 2.0)
    assert share_gpus(config, 4) is config
    with pytest.raises(GPUPlacementError, match=r"ask for 4 GPUs \(prefill: 1 x 2, decode: 1 x 2; prefill at "
                                                r"tensor_parallel_size 2, decode at tensor_parallel_size 2, a GPU a "
                                                r"rank\) and this node has 2: serve one colocated worker"):
        share_gpus(config, 2)
    colocated = cuda_config(**{"engine.tensor_parallel_size": 2, "prefill.count": 0, "decode.count": 0,
                               "colocated.count": 1})
    assert share_gpus(colocated, 2) is colocated and colocated.colocated.num_gpus == 2.0


def test_the_local_instance_is_told_the_nodes_gpus_not_the_demand(monkeypatch):
    """`tandem serve`'s own Ray instance declares the node's GPUs (1 here), with the groups fitted on
    it; before, it declared what the groups asked (2), and Ray handed the second worker GPU 1."""
    from cluster.serve import local_ray

    started = {}

    def fake_start(num_cpus, num_gpus, resources=None, timeout_s=120.0):
        started.update(num_cpus=num_cpus, num_gpus=num_gpus)
        return "a local ray"

    monkeypatch.setattr(local_ray.LocalRay, "start", staticmethod(fake_start))
    config = launch.fit_gpus(cuda_config(), 1)
    assert launch._start_local_ray(config, 1) == "a local ray" and started["num_gpus"] == 1
    assert gpu_demand(config) == 1.0
    with pytest.raises(launch.ServeStartError, match="no GPU"):
        launch.fit_gpus(cuda_config(), 0)
    joined = cuda_config()
    assert launch.fit_gpus(joined, None) is joined  # a cluster Ray already runs: its own resources decide
