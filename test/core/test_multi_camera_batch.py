"""Several cameras' frames in one batched trunk (``stream.multi.submit_batch``, issue 20).

On the CPU the graphed steps' static-shape path runs eagerly (the step capture
``multi_camera_helpers.EagerStaticSteps``), so
the batched trunk (``graphs.BatchedTrunk`` with ``capture=False``) and all the bookkeeping
around it (plans, speculation, landing, per-camera heads) run here; the GPU test
(``test/gpu/test_multi_camera_gpu.py``) replays the same through CUDA graphs. Per camera the
outputs must equal a separate single-camera replay (fp32, <= 1e-4), whatever subsets of
cameras arrive together; a camera that fails in a batch changes nothing of the others.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.pool import FramewiseAttention, KVPool, PoolAttention, make_device_plan
from lingbot_map_ros.cache.pages import PageTable
from lingbot_map_ros.cache.attention import make_backend
from lingbot_map_ros.stream.errors import InvalidFrameError
from lingbot_map_ros.stream.graphs import BatchedTrunk
from lingbot_map_ros.stream.multi import CameraSessions, submit_batch
from lingbot_map_ros.stream.session import StreamingSession

from multi_camera_helpers import EagerStaticSteps, assert_same, cfg, replay, sequences  # test/ is on sys.path


@pytest.fixture(scope="module")
def images(fixtures):
    return torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])


def batched_cameras(model, fixture_config, n: int, fused: bool | None = None, **kw) -> CameraSessions:
    return CameraSessions(model, {f"cam{i}": (cfg(fixture_config, **kw), None) for i in range(n)},
                          steps=EagerStaticSteps(), fused=fused)


def collect(cams, pending, name, sink) -> None:
    if isinstance(pending, Exception):
        raise AssertionError(f"{name}: {type(pending).__name__}: {pending}")
    sink[name] += cams.sessions[name].results(pending)


def submit_round(cams, frames, sink, keyframes=None) -> None:
    """One ``submit_many`` call; every camera's results into ``sink`` (a failure is an AssertionError)."""
    for name, pending in cams.submit_many(frames, keyframes).items():
        collect(cams, pending, name, sink)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_cameras_equal_their_single_camera_replays_in_any_arrival_pattern(tiny_model, fixture_config,
                                                                                 images, seed):
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 3)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    nxt = {c: 0 for c in cams.names}
    results = {c: [] for c in cams.names}
    rng = random.Random(seed)
    sizes = []
    while any(nxt[c] < len(seqs[c]) for c in cams.names):
        left = [c for c in cams.names if nxt[c] < len(seqs[c])]
        arriving = rng.sample(left, rng.randint(1, len(left)))  # any subset arrives together
        submit_round(cams, {c: seqs[c][nxt[c]] for c in arriving}, results)
        sizes.append(len(arriving))
        for c in arriving:
            nxt[c] += 1
    for c in cams.names:
        assert_same(results[c], replay(tiny_model, config, seqs[c]))
    batched = {c: cams.inner[c].batched_steps for c in cams.names}
    assert sum(batched.values()) >= 4, (batched, sizes)  # the batched trunk really ran
    assert all(isinstance(b, BatchedTrunk) for b in cams.inner["cam0"].batch_group.batches.values())


def test_forced_keyframe_decisions_in_a_batch_match_the_replay(tiny_model, fixture_config, images):
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 2)
    seqs = dict(zip(cams.names, sequences(images, 2)))
    s0 = config.num_scale_frames
    pattern = {"cam0": [None] * s0 + [i % 3 == 0 for i in range(12 - s0)],
               "cam1": [None] * s0 + [i % 2 == 1 for i in range(12 - s0)]}
    results = {c: [] for c in cams.names}
    for i in range(12):
        submit_round(cams, {c: seqs[c][i] for c in cams.names}, results, {c: pattern[c][i] for c in cams.names})
    for c in cams.names:
        assert_same(results[c], replay(tiny_model, config, seqs[c], pattern[c]))
        # the scale frames go together in phase 1 and the next frame captures (here: makes) each
        # camera's own one-frame step; every later frame ran in the batch
        assert cams.inner[c].batched_steps == 12 - s0 - 1


def test_a_bad_frame_in_a_batch_fails_alone_and_the_others_run(tiny_model, fixture_config, images):
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 3)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    results = {c: [] for c in cams.names}
    for i in range(10):
        submit_round(cams, {c: seqs[c][i] for c in cams.names}, results)
    small = seqs["cam1"][10][:, :28, :]  # another size than cam1's sequence
    before = cams.inner["cam1"].frames_pushed, cams.inner["cam1"].stats()
    out = cams.submit_many({"cam0": seqs["cam0"][10], "cam1": small, "cam2": seqs["cam2"][10]})
    assert isinstance(out["cam1"], InvalidFrameError) and "size changed" in str(out["cam1"])
    assert (cams.inner["cam1"].frames_pushed, cams.inner["cam1"].stats()) == before
    for c in ("cam0", "cam2"):
        collect(cams, out[c], c, results)
    submit_round(cams, {c: seqs[c][i] for c in cams.names for i in [10 if c == "cam1" else 11]}, results)
    for c in cams.names:
        n = 11 if c == "cam1" else 12
        assert_same(results[c], replay(tiny_model, config, seqs[c][:n]))
    s0 = config.num_scale_frames
    assert cams.inner["cam0"].batched_steps == 12 - s0 - 1
    assert cams.inner["cam1"].batched_steps == 11 - s0 - 1  # its refused frame never ran


def test_a_camera_still_collecting_scale_frames_goes_alone_while_the_others_batch(tiny_model, fixture_config,
                                                                                  images):
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 3)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    results = {c: [] for c in cams.names}
    late = 4  # cam2 starts 4 frames later
    for i in range(12 + late):
        frames = {c: seqs[c][i] for c in ("cam0", "cam1") if i < 12}
        if i >= late:
            frames["cam2"] = seqs["cam2"][i - late]
        submit_round(cams, frames, results)
    for c in cams.names:
        assert_same(results[c], replay(tiny_model, config, seqs[c]))
    assert cams.inner["cam2"].batched_steps > 0 and cams.inner["cam0"].batched_steps > 0


def test_reset_and_rollback_of_one_camera_between_batches(tiny_model, fixture_config, images):
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 2)
    seqs = dict(zip(cams.names, sequences(images, 2)))
    results = {c: [] for c in cams.names}
    for i in range(10):
        submit_round(cams, {c: seqs[c][i] for c in cams.names}, results)
    cams.inner["cam1"].wait()
    assert cams.sessions["cam1"].rollback_last_frame() == 9
    cams.sessions["cam0"].reset()
    for i in range(10, 12):
        submit_round(cams, {c: seqs[c][i] for c in cams.names}, results)
    # cam1: frame 10 published, then rolled back; frames 11, 12 get indices 9, 10. cam0: a new
    # sequence, whose first frames are scale frames again
    expect1 = replay(tiny_model, config, seqs["cam1"][:10]) + _replay_with_rollback(tiny_model, config, seqs["cam1"])
    assert_same(results["cam1"], expect1)
    assert_same(results["cam0"][10:], replay(tiny_model, config, seqs["cam0"][10:12]))


def _replay_with_rollback(model, config, frames) -> list:
    s = StreamingSession(model, config)
    for f in frames[:10]:
        s.push(f)
    s.rollback_last_frame()
    return s.push(frames[10]) + s.push(frames[11])


def test_framewise_attention_is_each_frame_over_its_own_pool():
    torch.manual_seed(0)
    ps, heads, dim = 8, 2, 8
    parts, qs, ks, vs = [], [], [], []
    for cam in range(3):
        table = PageTable(ps, 2, 4, 64, 4)
        pool = KVPool(1, table.num_pages, ps, heads, dim, torch.float32, torch.device("cpu"))
        plan = table.plan_step(2, True)
        table.apply(plan)
        plan = table.plan_step(1, True)
        dplan = make_device_plan(plan, ps + 6, torch.device("cpu"))
        backend = make_backend("sdpa", torch.device("cpu"))
        backend.begin_step(dplan)
        pool.k.normal_()
        pool.v.normal_()
        parts.append(PoolAttention(pool, backend, dplan.write_slots))
        qs.append(torch.randn(ps + 6, heads, dim))
        ks.append(torch.randn(ps + 6, heads, dim))
        vs.append(torch.randn(ps + 6, heads, dim))
    snapshot = [(p.pool.k.clone(), p.pool.v.clone()) for p in parts]
    out = FramewiseAttention(parts)(0, torch.cat(qs), torch.cat(ks), torch.cat(vs))
    after = [(p.pool.k.clone(), p.pool.v.clone()) for p in parts]
    for p, (k0, v0) in zip(parts, snapshot):  # back to before, then each frame alone
        p.pool.k.copy_(k0)
        p.pool.v.copy_(v0)
    alone = torch.cat([p(0, q, k, v) for p, q, k, v in zip(parts, qs, ks, vs)])
    assert torch.equal(out, alone)
    for p, (k1, v1) in zip(parts, after):
        assert torch.equal(p.pool.k, k1) and torch.equal(p.pool.v, v1)
    with pytest.raises(ValueError, match="do not split"):
        FramewiseAttention(parts)(0, qs[0][:7], ks[0][:7], vs[0][:7])


def test_submit_batch_refuses_mismatched_arguments(tiny_model, fixture_config, images):
    cams = batched_cameras(tiny_model, fixture_config, 2)
    inner = list(cams.inner.values())
    with pytest.raises(ValueError, match="appears twice"):
        submit_batch([inner[0], inner[0]], [images[0], images[1]])
    with pytest.raises(ValueError, match="2 sessions, 1 frames"):
        submit_batch(inner, [images[0]])
    with pytest.raises(KeyError, match="unknown cameras"):
        cams.submit_many({"rear": images[0]})


def test_long_stream_cameras_batch_and_restart_their_windows_like_their_own_sessions(tiny_model, fixture_config,
                                                                                     images):
    """Windowed restarts (LongStreamSession) decide and restart before the batched step; per
    camera the results equal a LongStreamSession of its own fed the same frames."""
    from lingbot_map_ros.config import LongStreamConfig
    from lingbot_map_ros.stream.long_stream import LongStreamSession

    config = cfg(fixture_config)
    long_cfg = LongStreamConfig(window_frames=6, overlap_frames=2)
    cams = CameraSessions(tiny_model, {c: (config, long_cfg) for c in ("cam0", "cam1")}, steps=EagerStaticSteps())
    seqs = dict(zip(cams.names, sequences(images, 2)))
    frames = {c: seqs[c] + seqs[c][::-1] for c in cams.names}  # 24 frames: several windows
    results = {c: [] for c in cams.names}
    for i in range(24):
        submit_round(cams, {c: frames[c][i] for c in cams.names}, results)
    for c in cams.names:
        own = LongStreamSession(StreamingSession(tiny_model, config), long_cfg)
        ref = []
        for f in frames[c]:
            ref += own.push(f)
        assert_same(results[c], ref)
        assert cams.sessions[c].window_index >= 2  # restarted at least twice
        assert cams.inner[c].batched_steps > 0


def test_storage_growth_for_another_resolution_rebuilds_the_batch_and_changes_no_result(tiny_model, fixture_config,
                                                                                       images):
    """cam0 and cam1 batch; cam2 starts later at a larger size: the storage grows (every extent
    moves to a new allocation), cam2 never batches with the others (another resolution), the
    others' batch is rebuilt on the moved storage, and every camera equals its replay."""
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 3)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    seqs["cam2"] = [torch.nn.functional.interpolate(f[None], size=(84, 98), mode="bilinear", align_corners=False)[0]
                    for f in seqs["cam2"]]
    results = {c: [] for c in cams.names}
    for i in range(12):
        frames = {c: seqs[c][i] for c in ("cam0", "cam1")}
        if i >= 5:
            frames["cam2"] = seqs["cam2"][i - 5]
        if i == 5:
            before = cams.inner["cam0"].batch_group.batches[("cam0", "cam1")]
        submit_round(cams, frames, results)
    assert cams.storage.generation == 1
    assert cams.inner["cam0"].batch_group.batches[("cam0", "cam1")] is not before  # rebuilt on the new storage
    assert cams.inner["cam2"].batched_steps == 0
    for c in ("cam0", "cam1"):
        assert_same(results[c], replay(tiny_model, config, seqs[c]))
    assert_same(results["cam2"], replay(tiny_model, config, seqs["cam2"][:7]))


def test_the_fused_path_of_a_batched_trunk_with_the_kernel_twins_equals_single_replays(tiny_model, fixture_config,
                                                                                     images, monkeypatch):
    """The aggregator's fused path over several cameras' frames (``FramewiseAttention``: per frame
    its rows of qkv and of the RoPE tables, its camera's destinations) with the PyTorch twins
    standing in for the Triton kernels, as on the GPU: per camera, the plain single-camera replay."""

    from lingbot_map_ros.kernels import layer_norm, qk_rope, residual
    from lingbot_map_ros.kernels import mlp as mlp_kernels

    config = cfg(fixture_config)
    expected = {f"cam{i}": replay(tiny_model, config, seq) for i, seq in enumerate(sequences(images, 3))}
    calls = {"qk_rows": []}

    def qk_twin(qkv, *a, **k):
        calls["qk_rows"].append(qkv.shape[0])
        return qk_rope.qk_norm_rope_reference(qkv, *a, **k)

    monkeypatch.setattr(residual, "residual_add", lambda x, b, g, norm=None, norm_dtype=torch.bfloat16:
                        residual.residual_add_reference(x, b, g, norm, norm_dtype))
    monkeypatch.setattr(mlp_kernels, "gelu_epilogue_mlp", lambda module, x: module(x))  # exact GELU
    monkeypatch.setattr(qk_rope, "qk_norm_rope", qk_twin)
    monkeypatch.setattr(layer_norm, "layer_norm", layer_norm.layer_norm_reference)
    from lingbot_map_ros.cache import pool as pool_module
    from lingbot_map_ros.kernels.camera_attention import camera_attention_reference

    monkeypatch.setattr(pool_module, "camera_attention", camera_attention_reference)  # bias None: computed there
    cams = batched_cameras(tiny_model, fixture_config, 3, fused=True)  # the sessions share the first's options
    assert all(inner.step_options.fused for inner in cams.inner.values())
    seqs = dict(zip(cams.names, sequences(images, 3)))
    results = {c: [] for c in cams.names}
    for i in range(12):
        calls["qk_rows"].clear()
        submit_round(cams, {c: seqs[c][i] for c in cams.names}, results)
    # the last step was batched: per layer, one frame-attention call over all 3 frames' rows and one
    # global call per camera over its own frame's rows
    tokens = calls["qk_rows"][1]
    assert calls["qk_rows"][0] == 3 * tokens and len(calls["qk_rows"]) == 4 * tiny_model.cfg.depth
    for c in cams.names:
        assert cams.inner[c].batched_steps == 12 - config.num_scale_frames - 1
        assert [r.frame_index for r in results[c]] == [r.frame_index for r in expected[c]]
        for a, b in zip(results[c], expected[c]):
            np.testing.assert_allclose(a.pose_enc, b.pose_enc, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(a.depth, b.depth, rtol=1e-4, atol=1e-5)


def test_a_failing_batched_trunk_falls_back_to_each_cameras_own_step_and_is_not_retried(
        tiny_model, fixture_config, images, monkeypatch, caplog):
    config = cfg(fixture_config)
    cams = batched_cameras(tiny_model, fixture_config, 2)
    seqs = dict(zip(cams.names, sequences(images, 2)))
    attempts = []

    def broken(self, frames, dplans):  # fails after taking the steps' plans, as a failed capture would
        attempts.append(len(frames))
        for step, dplan in zip(self.steps, dplans):
            step.take_plan(dplan)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(BatchedTrunk, "launch", broken)
    results = {c: [] for c in cams.names}
    with caplog.at_level("WARNING"):
        for i in range(12):
            submit_round(cams, {c: seqs[c][i] for c in cams.names}, results)
    for c in cams.names:
        assert_same(results[c], replay(tiny_model, config, seqs[c]))
        assert cams.inner[c].batched_steps == 0
    assert attempts == [2]  # tried once, then never again for this pair
    shared = cams.inner["cam0"].batch_group
    assert "RuntimeError: operation not permitted" in shared.refused[("cam0", "cam1")]
    warnings = [r for r in caplog.records if "batched step failed" in r.getMessage()]
    assert len(warnings) == 1 and "cam0, cam1" in warnings[0].getMessage()


def test_each_cameras_outputs_land_before_the_next_cameras_heads_run(tiny_model, fixture_config, images,
                                                                     monkeypatch):
    """The heads graphs of all cameras share one memory pool, where an earlier captured graph may
    use another's outputs as scratch: a batch lands camera k's outputs before camera k+1's heads
    run (on the H200 the batch once replayed every heads graph first, and outputs were clobbered)."""
    from lingbot_map_ros.stream.graphs import GraphedStep
    from lingbot_map_ros.stream.steps import StepRunner

    cams = batched_cameras(tiny_model, fixture_config, 3)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    owner = {id(cams.inner[c]): c for c in cams.names}
    events = []
    heads, land = GraphedStep.heads, StepRunner._land

    def logged_heads(self, levels, positions):
        events.append(("heads", self.camera))
        return heads(self, levels, positions)

    def logged_land(self, *args, **kwargs):
        events.append(("land", self.camera))
        return land(self, *args, **kwargs)

    monkeypatch.setattr(GraphedStep, "heads", logged_heads)
    monkeypatch.setattr(StepRunner, "_land", logged_land)
    results = {c: [] for c in cams.names}
    for i in range(len(seqs["cam0"])):
        events.clear()
        submit_round(cams, {c: seqs[c][i] for c in cams.names}, results)
    assert all(cams.inner[c].batched_steps > 0 for c in cams.names)
    # the last round was batched: heads and landing alternate, camera by camera
    cameras = [cams.inner[c]._runner.camera for c in cams.names]
    assert events == [e for cam in cameras for e in (("heads", cam), ("land", cam))], \
        [(kind, owner.get(id(cam))) for kind, cam in events]
    for c in cams.names:
        assert_same(results[c], replay(tiny_model, cfg(fixture_config), seqs[c]))


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_hand_off_waits_only_after_a_recorded_hand_over(monkeypatch):
    """Every trunk of a shared graph pool waits for the last hand-over of any of them."""
    from lingbot_map_ros.stream import graphs

    class Event:
        def __init__(self):
            self.recorded_on = []

        def record(self, stream):
            self.recorded_on.append(stream)

    monkeypatch.setattr(graphs.torch.cuda, "Event", Event)
    hand_off = graphs.HandOff()
    trunk = _Stream()
    hand_off.wait(trunk)
    assert trunk.waited == []  # nothing was handed over yet: nothing to wait for
    heads = object()
    hand_off.record(heads)
    hand_off.wait(trunk)
    hand_off.wait(trunk)
    assert len(trunk.waited) == 2 and trunk.waited[0] is trunk.waited[1]
    assert trunk.waited[0].recorded_on == [heads]


def test_captures_reuse_one_warm_up_stream_per_device(monkeypatch):
    """Every new stream that runs a matrix product keeps a cuBLAS workspace (32 MiB on an H200)
    for the life of the process: the warm-ups before captures share one stream per device."""
    from lingbot_map_ros.stream import graphs

    made = []

    class Stream:
        def __init__(self, device=None):
            made.append(device)

    monkeypatch.setattr(graphs.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(graphs.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(graphs, "_warmup_streams", {})
    first = graphs.warmup_stream("cuda:0")
    assert graphs.warmup_stream(torch.device("cuda", 0)) is first
    assert graphs.warmup_stream(torch.device("cuda")) is first
    other = graphs.warmup_stream("cuda:1")
    assert other is not first and graphs.warmup_stream("cuda:1") is other
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
