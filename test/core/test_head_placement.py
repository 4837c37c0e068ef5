"""Where the model's float32 heads live (``stream.session.place_heads``): on the GPU only while a
session runs them, in host memory while every session runs its bf16 copies. CPU only: the
moves are recorded by a stand-in, the device is named but never touched."""
from __future__ import annotations

import gc

import torch
from torch import nn

from lingbot_map_ros.config import ModelConfig
from lingbot_map_ros.model.lingbot import LingBotMap, StepOptions
from lingbot_map_ros.stream.session import PARKED, place_heads

GPU = torch.device("cuda")
COPIES = StepOptions(with_depth=True, camera_head=nn.Identity(), depth_head=nn.Identity())
OWN = StepOptions(with_depth=True)  # the model's own heads
NO_DEPTH = StepOptions(with_depth=False, camera_head=nn.Identity())


class Session:  # a user: only its identity and lifetime matter
    pass


def tracker(model: LingBotMap):
    """A ``move`` stand-in and the place of each head it last sent somewhere."""
    names = {id(model.camera_head): "camera_head", id(model.depth_head): "depth_head"}
    where = {"camera_head": GPU, "depth_head": GPU}

    def move(head: nn.Module, device: torch.device) -> None:
        where[names[id(head)]] = device

    return move, where


def tiny() -> LingBotMap:
    with torch.device("meta"):
        return LingBotMap(ModelConfig.preset("tiny"))


def test_heads_are_parked_while_every_session_runs_copies():
    model = tiny()
    move, where = tracker(model)
    a = Session()
    place_heads(model, GPU, COPIES, a, move)
    assert where == {"camera_head": PARKED, "depth_head": PARKED}
    b = Session()
    place_heads(model, GPU, COPIES, b, move)  # a second camera with copies: still parked
    assert where == {"camera_head": PARKED, "depth_head": PARKED}


def test_a_session_running_the_own_heads_brings_them_back_and_keeps_them_while_it_lives():
    model = tiny()
    move, where = tracker(model)
    a = Session()
    place_heads(model, GPU, COPIES, a, move)
    b = Session()
    place_heads(model, GPU, OWN, b, move)
    assert where == {"camera_head": GPU, "depth_head": GPU}
    c = Session()
    place_heads(model, GPU, COPIES, c, move)  # b still runs them: they stay
    assert where == {"camera_head": GPU, "depth_head": GPU}
    del b
    gc.collect()
    place_heads(model, GPU, COPIES, Session(), move)  # b is gone: the next session parks them
    assert where == {"camera_head": PARKED, "depth_head": PARKED}


def test_each_head_on_its_own_and_a_session_that_changes_its_options():
    model = tiny()
    move, where = tracker(model)
    a = Session()
    place_heads(model, GPU, NO_DEPTH, a, move)  # no depth: the depth head is not needed at all
    assert where == {"camera_head": PARKED, "depth_head": PARKED}
    place_heads(model, GPU, StepOptions(with_depth=True, camera_head=nn.Identity()), a, move)
    assert where == {"camera_head": PARKED, "depth_head": GPU}
    place_heads(model, GPU, COPIES, a, move)  # a no longer needs it, nobody else does
    assert where == {"camera_head": PARKED, "depth_head": PARKED}


def test_nothing_moves_on_the_cpu():
    model = tiny()
    move, where = tracker(model)
    moved = []
    place_heads(model, torch.device("cpu"), COPIES, Session(), lambda h, d: moved.append(d))
    assert moved == [] and where == {"camera_head": GPU, "depth_head": GPU}

