"""A known scene for the loop-closure tests (not a test module; test/ is on sys.path): a camera
moving inside a box room, what a drifting front end reports of it, and a stand-in for the model's
side session that knows the true geometry.

- ``room_depth(c2w, K, h, w)``: z-depth of the room's walls (a box ``[-X, X] x [-Y, Y] x [-Z, Z]``,
  OpenCV axes: y down) seen from ``c2w``.
- ``place_image(seed, h, w)``: an image whose look is its seed's own (oriented gratings): the same
  seed gives the same image, other seeds look different to a gradient descriptor.
- ``circuit(n)``: true camera poses of a loop around the room's centre (yaw turning, camera level).
- ``drifted(poses, ...)``: what a drifting front end would report (a yaw and a translation error
  growing with each step).
- ``TrueSideRunner``: ``runtime.loop_verify.SideRunner`` answering from the true poses of the images
  it is given (looked up by their bytes), with the true depth.
- ``tagged(image, ident)`` / ``tag_of(image)``: a frame's identity written into (and read back from)
  a 16x16 grey corner block that survives the JPEG of the keyframe store;
- ``SceneInner``: a stand-in for the node's inner ``StreamingSession``: the real (tiny) model runs,
  but each result's pose, depth, confidence and intrinsics are replaced by the scene's: the
  front end's reported pose of the frame's identity relative to the first frame since the last
  reset (the window's world, as the model would give it), the true depth. ``LongStreamSession``
  around it does everything else for real (windows, restarts, the relocalisation's alignment).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from lingbot_map_ros.geometry import matrix_to_quaternion
from lingbot_map_ros.runtime.loop_verify import SideView

ROOM = (4.0, 1.5, 4.0)  # half extents x, y, z (model units)
H, W = 56, 98
K = np.array([[60.0, 0.0, W / 2], [0.0, 60.0, H / 2], [0.0, 0.0, 1.0]])


def room_depth(c2w: np.ndarray, K: np.ndarray = K, h: int = H, w: int = W) -> np.ndarray:
    """[h, w] float32 z-depth of the box room's walls from camera ``c2w`` (OpenCV axes)."""
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    rays = np.stack([(u - K[0, 2]) / K[0, 0], (v - K[1, 2]) / K[1, 1], np.ones_like(u)], -1)  # z = 1
    R, c = c2w[:3, :3], c2w[:3, 3]
    d = rays @ R.T
    half = np.array(ROOM)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d > 0, (half - c) / d, np.where(d < 0, (-half - c) / d, np.inf))
    return t.min(axis=-1).astype(np.float32)  # along a z = 1 ray, the ray parameter is the z-depth


def place_image(seed: int, h: int = H, w: int = W) -> np.ndarray:
    """uint8 [h, w, 3]: three oriented gratings and a blob of the seed's own."""
    rng = np.random.default_rng(seed)
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w))
    for _ in range(3):
        angle, freq, phase = rng.uniform(0, np.pi), rng.uniform(0.08, 0.4), rng.uniform(0, 2 * np.pi)
        img += np.sin(freq * (u * np.cos(angle) + v * np.sin(angle)) + phase)
    cy, cx = rng.uniform(0, h), rng.uniform(0, w)
    img += 2.0 * np.exp(-((v - cy) ** 2 + (u - cx) ** 2) / (2 * (0.15 * w) ** 2))
    img = (img - img.min()) / (np.ptp(img) + 1e-9)
    tint = rng.uniform(0.5, 1.0, 3)
    return np.clip(img[..., None] * tint * 255, 0, 255).astype(np.uint8)


def yaw_pose(yaw: float, centre: np.ndarray) -> np.ndarray:
    """c2w of a level camera (OpenCV: y down) at ``centre`` looking along yaw about -y."""
    c, s = np.cos(yaw), np.sin(yaw)
    T = np.eye(4)
    T[:3, :3] = [[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]]
    T[:3, 3] = centre
    return T


def circuit(n: int, radius: float = 1.0) -> list[np.ndarray]:
    """n true poses around a circle of ``radius`` about the room's centre, one full turn."""
    out = []
    for i in range(n):
        a = 2 * np.pi * i / n
        out.append(yaw_pose(a + np.pi / 2, np.array([radius * np.cos(a), 0.0, radius * np.sin(a)])))
    return out


def drifted(poses: list[np.ndarray], yaw_per_step: float = 0.004, shift_per_step: float = 0.004) -> list[np.ndarray]:
    """What a drifting front end reports: each step's motion taken with a small yaw and a sideways
    error, accumulated."""
    out = [poses[0].copy()]
    err = yaw_pose(yaw_per_step, np.array([shift_per_step, 0.0, 0.0]))
    for a, b in zip(poses[:-1], poses[1:]):
        step = np.linalg.inv(a) @ b
        out.append(out[-1] @ err @ step)
    return out


class TrueSideRunner:
    """A side session that knows where each image was taken: ``truth`` is a list of (image, true
    c2w); an image it is given is the nearest of them (the loop closer hands back JPEG copies); the
    answer is the true poses relative to the first image's camera, with the true depth (full
    confidence)."""

    def __init__(self, truth: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.images = np.stack([im.astype(np.float32) for im, _ in truth])
        self.poses = [P for _, P in truth]
        self.calls = 0

    def pose_of(self, image: np.ndarray) -> np.ndarray:
        err = np.abs(self.images - image.astype(np.float32)[None]).mean(axis=(1, 2, 3))
        return self.poses[int(np.argmin(err))]

    def run(self, images: list[np.ndarray]) -> list[SideView]:
        self.calls += 1
        poses = [self.pose_of(im) for im in images]
        first = np.linalg.inv(poses[0])
        h, w = images[0].shape[:2]
        return [SideView(first @ P, room_depth(P, K, h, w), np.full((h, w), 5.0, np.float32), K) for P in poses]


TAG = 16  # the identity block's side (one JPEG macroblock: its colour is not mixed with the texture's)


def tagged(image: np.ndarray, ident: int) -> np.ndarray:
    """``image`` with ``ident`` (0..62) written as the grey level of its top-left TAG x TAG block."""
    if not 0 <= ident < 63:
        raise ValueError(f"identity {ident} out of range")
    out = image.copy()
    out[:TAG, :TAG] = 4 * ident + 2
    return out


def tag_of(image: np.ndarray) -> int:
    """The identity ``tagged`` wrote (uint8 [H, W, 3], or float [3, H, W] in [0, 1])."""
    a = np.asarray(image)
    block = a[:TAG, :TAG].astype(np.float64) if a.dtype == np.uint8 else 255.0 * np.moveaxis(a[:, :TAG, :TAG], 0, -1)
    return int(round((float(np.median(block)) - 2.0) / 4.0))


class _Rewritten:
    """A pending step whose results ``SceneInner`` rewrites when they are taken."""

    def __init__(self, pending, owner: "SceneInner") -> None:
        self._p, self._owner = pending, owner

    def __getattr__(self, name):
        return getattr(self._p, name)

    def result(self):
        return [self._owner.rewrite(r) for r in self._p.result()]


class SceneInner:
    """See the module docstring. ``reported`` / ``true``: {identity: c2w} of the front end and of
    the truth (OpenCV axes); ``calls`` counts the frames rewritten."""

    def __init__(self, inner, reported: dict[int, np.ndarray], true: dict[int, np.ndarray]) -> None:
        self._s, self.reported, self.true = inner, reported, true
        self._origin: int | None = None
        self.calls = 0
        self.blind: set[int] = set()  # identities whose confidence collapses (a lost track)

    def __getattr__(self, name):
        return getattr(self._s, name)

    def reset(self) -> None:
        self._s.reset()
        self._origin = None

    def step(self, frame, store):
        return _Rewritten(self._s.step(frame, store), self)

    def push(self, image, keyframe=None, stamp=None, tag=None):
        return [self.rewrite(r) for r in self._s.push(image, keyframe)]

    def rewrite(self, r):
        self.calls += 1
        ident = tag_of(r.frame)
        if r.frame_index == 0:
            self._origin = ident
        c2w = np.linalg.inv(self.reported[self._origin]) @ self.reported[ident]
        h, w = r.depth.shape if r.depth is not None else (H, W)
        pose_enc = np.concatenate([c2w[:3, 3], matrix_to_quaternion(c2w[:3, :3]), np.asarray(r.pose_enc)[7:9]])
        return replace(r, c2w=c2w, pose_enc=pose_enc.astype(np.asarray(r.pose_enc).dtype), intrinsics=K.copy(),
                       depth=room_depth(self.true[ident], K, h, w),
                       confidence=np.full((h, w), 0.0 if ident in self.blind else 5.0, np.float32))


__all__ = ["TAG", "tagged", "tag_of", "SceneInner", "ROOM", "H", "W", "K", "room_depth", "place_image", "yaw_pose", "circuit", "drifted", "TrueSideRunner"]
