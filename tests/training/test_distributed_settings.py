"""Issue 18, items 6 and 7: the process group's timeout comes from the config (default ≥ 60 min,
what rank 0's checkpoint write needs), and DDP does not broadcast the deterministic RoPE buffers."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as torch_dist
from builders import CPU, micro_batches, tiny_loss_model

from pipeline import distributed
from pipeline.config import resolve_config
from pipeline.errors import ConfigError
from pipeline.training.parallelize import wrap
from pipeline.training.step import accumulate_gradients, count_tokens


def test_timeout_default_is_an_hour_and_configurable():
    assert resolve_config({})["hardware"]["process_group_timeout_min"] == 60 == distributed.DEFAULT_TIMEOUT_MIN
    assert resolve_config({"hardware": {"process_group_timeout_min": 120}})["hardware"][
        "process_group_timeout_min"] == 120
    with pytest.raises(ConfigError, match="process_group_timeout_min"):
        resolve_config({"hardware": {"process_group_timeout_min": 0}})


@pytest.mark.parametrize("minutes", [60, 90])
def test_init_process_group_gets_the_configured_timeout(monkeypatch, minutes):
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch_dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch_dist, "get_rank", lambda: 0)
    monkeypatch.setattr(torch_dist, "get_world_size", lambda: 1)
    d = distributed.init_distributed("cpu", minutes)
    assert d.owns_group and seen["backend"] == "gloo"
    assert seen["timeout"] == timedelta(minutes=minutes)


def test_train_passes_the_configured_timeout():
    import inspect

    from pipeline.training import checkpoint, train

    assert "init_distributed(view.hardware.device, view.hardware.process_group_timeout_min)" in \
        inspect.getsource(train._run)
    assert "process_group_timeout_min" in checkpoint.OBSERVABILITY_KEYS["hardware"]  # an edit still resumes


def test_ddp_does_not_broadcast_the_rope_buffers(tmp_path, monkeypatch):
    """DDP's default broadcasts every buffer from rank 0 before each forward: with
    broadcast_buffers=False no broadcast runs in the step, and the only buffers are the RoPE tables."""
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp, fwd = wrap(tiny_loss_model(), CPU, compile_model=False)
        assert ddp.forward_sync_buffers is False
        assert {n.split(".")[-1] for n, _ in ddp.module.named_buffers()} == {"rope_cos", "rope_sin"}
        calls = []
        real = torch_dist.broadcast
        monkeypatch.setattr(torch_dist, "broadcast", lambda *a, **k: calls.append(a) or real(*a, **k))
        coalesced = []
        monkeypatch.setattr(type(ddp), "_distributed_broadcast_coalesced",
                            lambda self, *a, **k: coalesced.append(a))
        batches = micro_batches(2)
        for _ in range(2):
            accumulate_gradients(ddp, fwd, batches, count_tokens(batches, CPU)[0], world_size=1)
        assert not coalesced and not calls
    finally:
        torch_dist.destroy_process_group()
