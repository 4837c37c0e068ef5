"""lingbot-map-replay: stream a folder of images through the model and save predictions.

    lingbot-map-replay --images DIR --checkpoint PATH --model-config JSON --out predictions.npz

The npz holds pose_enc [S,9], depth [S,H,W], depth_conf [S,H,W], pose_c2w [S,4,4]
(camera-to-world, OpenCV axes, world = first camera), intrinsics [S,3,3] and
is_keyframe [S]. Progress and per-frame timing go to stderr. Any input problem
ends with one line ``lingbot-map-replay: error: ...`` and exit status 2.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

PROG = "lingbot-map-replay"


class UserError(Exception):
    """A problem with the user's input, reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--images", required=True, type=Path, help="folder of images (sorted by name)")
    p.add_argument("--checkpoint", help="checkpoint .pt/.safetensors or Hugging Face id; omitted = random weights")
    p.add_argument("--model-config", type=Path,
                   help="model JSON (e.g. the fixture config.json); default: released configuration")
    p.add_argument("--out", required=True, type=Path, help="output .npz")
    p.add_argument("--width", type=int, default=None, help="model input width, multiple of 14 (default 518, "
                   "or preprocess_width of the model config)")
    p.add_argument("--num-scale-frames", type=int)
    p.add_argument("--sliding-window", type=int)
    p.add_argument("--keyframe-interval", type=int)
    p.add_argument("--camera-iterations", type=int)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flashinfer", "flashinfer-fa2",
                                                          "flashinfer-fa3"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--max-frames", type=int)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights when no checkpoint is given")
    p.add_argument("--trajectory", type=Path, help="also write the trajectory in TUM format")
    p.add_argument("--ply", type=Path, help="also write the point cloud (conf > 1.5, every 10th point) as PLY")
    p.add_argument("--no-depth", action="store_true", help="skip the depth head (poses only)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-frame progress")
    return p


def configure(args: argparse.Namespace):
    """Resolve (ModelConfig, StreamConfig, width) from the JSON file and flags."""
    from ..config import ConfigError, ModelConfig, StreamConfig, load_json

    try:
        data = load_json(args.model_config) if args.model_config else {}
        model_cfg = ModelConfig.from_dict(data) if data else ModelConfig.preset("lingbot-map")
        stream_cfg = StreamConfig.from_dict(data).with_overrides(
            num_scale_frames=args.num_scale_frames, sliding_window=args.sliding_window,
            keyframe_interval=args.keyframe_interval, camera_iterations=args.camera_iterations,
            device=args.device, backend=args.backend, dtype=args.dtype)
    except (ConfigError, TypeError) as exc:
        raise UserError(str(exc)) from None
    width = args.width or int(data.get("preprocess_width", 518))
    if width <= 0 or width % model_cfg.patch_size:
        raise UserError(f"--width {width} is not a positive multiple of the patch size {model_cfg.patch_size}")
    if args.max_frames is not None and args.max_frames <= 0:
        raise UserError(f"--max-frames must be positive, got {args.max_frames}")
    return model_cfg, stream_cfg, width


def run(args: argparse.Namespace) -> int:
    from ..cache.attention import BackendUnavailable
    from ..geometry import select_points, unproject_depth
    from ..io.checkpoint import CheckpointError, load_model
    from ..io.export import write_ply, write_tum
    from ..io.preprocess import ImageLoadError, list_images, load_image, preprocess_pil
    from ..stream.session import StreamingSession

    model_cfg, stream_cfg, width = configure(args)
    try:
        paths = list_images(args.images)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from None
    paths = paths[:args.max_frames] if args.max_frames else paths
    if len(paths) < stream_cfg.num_scale_frames:
        raise UserError(f"{len(paths)} image(s) in {args.images}, fewer than the {stream_cfg.num_scale_frames} "
                        "scale frames the model needs")
    try:
        t0 = time.perf_counter()
        model = load_model(model_cfg, args.checkpoint, stream_cfg.device, stream_cfg.dtype, seed=args.seed)
        session = StreamingSession(model, stream_cfg, with_depth=not args.no_depth)
        log(args, f"model ready in {time.perf_counter() - t0:.1f} s ({session.backend.name}, {stream_cfg.dtype}, "
                  f"{stream_cfg.device}); {len(paths)} frames")
    except (CheckpointError, BackendUnavailable) as exc:
        raise UserError(str(exc)) from None

    results = []
    start = last = time.perf_counter()

    def take(pending) -> None:
        nonlocal last
        out = pending.result()
        results.extend(out)
        if out and not args.quiet:
            now = time.perf_counter()
            ms, last = (now - last) * 1e3 / len(out), now
            for r in out:
                log(args, f"frame {r.frame_index:5d} {'K' if r.is_keyframe else '-'} {ms:8.1f} ms/frame")

    # frames are submitted one ahead: the next image is read and preprocessed while the
    # GPU runs the current step, whose results are taken afterwards
    waiting = None
    for path in paths:
        try:
            image = preprocess_pil(load_image(path), width)
        except (ImageLoadError, ValueError) as exc:
            raise UserError(str(exc)) from None
        try:
            submitted = session.submit(image)
        except ValueError as exc:
            raise UserError(f"{path.name}: {exc}") from None
        if waiting is not None:
            take(waiting)
        waiting = submitted
    if waiting is not None:
        take(waiting)
    total = time.perf_counter() - start
    log(args, f"{len(results)} frames in {total:.2f} s ({len(results) / max(total, 1e-9):.2f} FPS)")

    arrays = {
        "pose_enc": np.stack([r.pose_enc for r in results]),
        "pose_c2w": np.stack([r.c2w for r in results]),
        "intrinsics": np.stack([r.intrinsics for r in results]),
        "is_keyframe": np.array([r.is_keyframe for r in results]),
    }
    if not args.no_depth:
        arrays["depth"] = np.stack([r.depth for r in results])
        arrays["depth_conf"] = np.stack([r.confidence for r in results])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **arrays)
    if args.trajectory:
        write_tum(args.trajectory, np.arange(len(results), dtype=np.float64), arrays["pose_c2w"])
    if args.ply:
        if args.no_depth:
            raise UserError("--ply needs depth; drop --no-depth")
        clouds = []
        for r in results:
            pts = unproject_depth(r.depth, r.intrinsics, r.c2w)
            h, w = r.size
            colors = r.colors(np.arange(h * w)).reshape(h, w, 3)
            clouds.append(select_points(pts, colors, r.confidence, conf_threshold=1.5, stride=10)[:2])
        write_ply(args.ply, np.concatenate([c[0] for c in clouds]), np.concatenate([c[1] for c in clouds]))
    log(args, f"wrote {args.out}")
    return 0


def log(args: argparse.Namespace, message: str) -> None:
    if not args.quiet or message.startswith("wrote"):
        print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s")
    try:
        return run(args)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
