"""The CUDA-path findings of issue 14, shown on CPU where they can be: gradients stay DDP bucket views
across accumulation micro-steps, the fp32 MFU peak, fp8-free reference statistics, no host sync in
the step, prefetched batches with an exact loader state, memory-mapped checkpoint loading."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist
from builders import CPU, micro_batches, tiny_loss_model, write_pack

from pipeline.config import resolve_config
from pipeline.data.loader import DataExhausted, PackedLoader
from pipeline.model.checkpoint_io import load_checkpoint, save_checkpoint
from pipeline.planning.compute import PEAK_FLOPS, peak_flops
from pipeline.run_config import run_config
from pipeline.training.parallelize import set_matmul_precision, wrap
from pipeline.training.step import (
    StepBatches,
    accumulate_gradients,
    clip_gradients,
    count_tokens,
    plain_hidden,
    zero_gradients,
)

VOCAB, SEQ = 64, 8


# ----------------------------------------------------------------------------- gradients as bucket views

def _bucket_storages(ddp) -> set[int]:
    """data_ptrs of the storages DDP's gradient buckets live in (what a bucket-view gradient shares)."""
    return {p.grad.untyped_storage().data_ptr() for p in ddp.module.parameters() if p.grad is not None}


@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradients_stay_bucket_views_across_accumulation(tmp_path, set_to_none):
    """After an optimizer step, the trainer's zero_gradients keeps every gradient a view into DDP's
    buckets through the next step's no_sync micro-steps; zero_grad(set_to_none=True) — the old code —
    makes the no_sync backward allocate separate gradients (the whole gradient held twice)."""
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp, fwd = wrap(tiny_loss_model(), CPU, compile_model=False)
        opt = torch.optim.SGD(ddp.module.parameters(), lr=0.1)
        batches = micro_batches(3)
        for _ in range(2):  # DDP rebuilds its buckets once, after the first iteration
            accumulate_gradients(ddp, fwd, batches, count_tokens(batches, CPU)[0], world_size=1)
            buckets = _bucket_storages(ddp)
            assert len(buckets) >= 1 and all(p.grad._base is not None for p in ddp.module.parameters())
            opt.step()
            zero_gradients(opt) if not set_to_none else opt.zero_grad(set_to_none=True)
        with ddp.no_sync():  # the first micro-step of the next optimizer step
            loss_sum, _ = fwd(*batches[0])
            loss_sum.backward()
        views = [p.grad is not None and p.grad.untyped_storage().data_ptr() in buckets
                 for p in ddp.module.parameters()]
        assert all(views) != set_to_none
    finally:
        torch_dist.destroy_process_group()


def test_ddp_skips_the_buffer_broadcast_on_old_and_new_torch(tmp_path, monkeypatch):
    """forward_sync_buffers=False where DDP takes it (torch ≥ 2.13), broadcast_buffers=False on older torch,
    whose DDP has no such keyword (the lent H100's 2.11): DDP built either way broadcasts no buffers per forward."""
    import warnings

    import pipeline.training.parallelize as step

    class OldDDP(step.DDP):  # torch 2.11's keywords: no forward_sync_buffers
        def __init__(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
            taken.append(broadcast_buffers)
            super().__init__(module, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view,
                             forward_sync_buffers=broadcast_buffers)

    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # no deprecated keyword on torch 2.13
            new, _ = wrap(tiny_loss_model(), CPU, compile_model=False)
        assert step.no_buffer_sync() == {"forward_sync_buffers": False} and new.forward_sync_buffers is False
        taken: list = []
        monkeypatch.setattr(step, "DDP", OldDDP)
        assert step.no_buffer_sync() == {"broadcast_buffers": False}
        old, _ = wrap(tiny_loss_model(), CPU, compile_model=False)
        assert taken == [False] and old.forward_sync_buffers is False
    finally:
        torch_dist.destroy_process_group()


# ----------------------------------------------------------------------------- fp32 peak

def test_fp32_run_is_measured_against_the_true_fp32_peak():
    cfg = resolve_config({"train": {"precision": "fp32"}, "hardware": {"device": "cuda", "gpu_type": "H100"}})
    assert peak_flops(run_config(cfg)) == PEAK_FLOPS["H100"]["fp32"] == 66.9e12  # not TF32's 494.5e12
    cfg["train"]["precision"] = "bf16"
    assert peak_flops(run_config(cfg)) == 989e12
    before = torch.get_float32_matmul_precision()
    try:
        set_matmul_precision("fp32")
        assert torch.get_float32_matmul_precision() == "highest"
        set_matmul_precision("bf16")
        assert torch.get_float32_matmul_precision() == "highest"
        set_matmul_precision("tf32")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------------- fp8-free reference statistics

class FakeFloat8Linear(torch.nn.Linear):
    """Stands in for torchao's Float8Linear (an nn.Linear subclass): weights rounded through fp8."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(torch.float8_e4m3fn).float())


def test_reference_statistics_run_without_fp8():
    from pipeline.training.train import fixed_batch_stats

    model = tiny_loss_model().model
    batch = micro_batches(1, seed=3)[0]
    plain = fixed_batch_stats(model, batch, chunk=10)
    with torch.no_grad():
        before = model.hidden(batch[0])
    for block in model.layers:  # convert like apply_fp8 does: class swap, same parameters
        for lin in (*block.attention.children(), *block.feed_forward.children()):
            lin.__class__ = FakeFloat8Linear
    with torch.no_grad():
        fp8_hidden = model.hidden(batch[0])
        assert torch.equal(plain_hidden(model, batch[0]), before)
    assert not torch.allclose(fp8_hidden, before, atol=1e-4)  # the fp8 forward differs ...
    assert fixed_batch_stats(model, batch, chunk=10) == plain  # ... the statistics do not use it
    assert all(type(m) is FakeFloat8Linear for b in model.layers for m in b.feed_forward.children())


# ----------------------------------------------------------------------------- no host sync in the step

def test_step_has_no_device_to_host_sync():
    """accumulate → clip → zero: no op that reads a tensor's value on the host
    (`_local_scalar_dense`, what .item()/int()/bool() run — a device sync on CUDA). The token counts
    are summed from the host batches (count_tokens) before anything reaches the device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    lm = tiny_loss_model()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3, foreach=True)
    batches = micro_batches(2, masked=True)
    counts = count_tokens(batches, CPU)
    assert counts.tolist() == [int(sum(b[2].sum() for b in batches)), 2 * 2 * SEQ]

    class Spy(TorchDispatchMode):
        ops: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Spy.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Spy():
        accumulate_gradients(lm, lm, batches, counts[0], world_size=1)
        clip_gradients([p for p in lm.parameters()], 1.0)
    opt.step()  # torch's; foreach AdamW reads its CPU step counters, CUDA runs the fused kernel (device steps)
    with Spy():
        zero_gradients(opt)
    assert "_local_scalar_dense" not in Spy.ops and "silu_backward" in Spy.ops, sorted(Spy.ops)


# ----------------------------------------------------------------------------- prefetched batches

def test_prefetched_batches_and_state_match_the_plain_loader(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=40, with_mask=True)
    plain = PackedLoader(meta, 2, seed=5)
    steps = StepBatches(PackedLoader(meta, 2, seed=5), micro_steps=3, dist=CPU)
    try:
        for _ in range(6):  # 40 rows / 2 per micro-step = 20 micro-steps: 6 steps of 3
            batches, counts = steps.next_step()
            expected = [next(plain) for _ in range(3)]
            for got, want in zip(batches, expected):
                assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert counts.tolist() == count_tokens(expected, CPU).tolist()
            # the state is that of the consumed steps, though the thread has read one step further
            assert steps.state_dict() == plain.state_dict()
        with pytest.raises(DataExhausted):
            steps.next_step()
    finally:
        steps.close()


def test_resumed_prefetcher_continues_exactly(tmp_path):
    meta = write_pack(tmp_path / "p.json", n_rows=40)
    first = StepBatches(PackedLoader(meta, 2, seed=1), micro_steps=2, dist=CPU)
    first.next_step()
    state = first.state_dict()
    expected, _ = first.next_step()
    first.close()
    loader = PackedLoader(meta, 2, seed=1)
    loader.load_state_dict(state)
    resumed = StepBatches(loader, micro_steps=2, dist=CPU)
    got, _ = resumed.next_step()
    resumed.close()
    assert all(torch.equal(a, b) for g, e in zip(got, expected) for a, b in zip(g[:2], e[:2]))


# ----------------------------------------------------------------------------- checkpoint loading

def test_checkpoint_is_memory_mapped_not_read(tmp_path):
    """Each rank maps the file (pages shared, read on use) instead of reading a private copy."""
    path = tmp_path / "step_000001.pt"
    save_checkpoint(path, {"model": {"w": torch.arange(1 << 16, dtype=torch.float32)}, "step": 1})
    state = load_checkpoint(path)
    maps = open("/proc/self/maps").read()
    assert str(path.resolve()) in maps
    assert torch.equal(state["model"]["w"], torch.arange(1 << 16, dtype=torch.float32)) and state["step"] == 1
