"""The session the node and the command line hold is a ``stream.Session``, windowed or one window
(no LongStreamConfig), and stream/ is the one door to the errors."""
from __future__ import annotations

import inspect

import pytest

from lingbot_map_ros import stream
from lingbot_map_ros.config import LongStreamConfig, StreamConfig
from lingbot_map_ros.stream.long_stream import LongStreamSession
from lingbot_map_ros.stream.protocol import Session
from lingbot_map_ros.stream.session import StreamingSession

MEMBERS = [name for name in dir(Session) if not name.startswith("_")]


@pytest.fixture(scope="module")
def sessions(tiny_model, fixture_config):
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa")
    return {"plain": LongStreamSession(StreamingSession(tiny_model, cfg)),
            "long": LongStreamSession(StreamingSession(tiny_model, cfg), LongStreamConfig(window_frames=6))}


def test_the_protocol_names_what_the_node_uses():
    assert sorted(MEMBERS) == sorted(["cfg", "device", "frames_pushed", "window_index", "deferred_eviction", "push",
                                      "submit", "results", "check_frame", "reset", "rollback_last_frame",
                                      "set_deferred_eviction", "commit_eviction", "stats"])


@pytest.mark.parametrize("kind", ["plain", "long"])
def test_both_kinds_satisfy_it_with_the_same_signatures(sessions, kind):
    session = sessions[kind]
    assert isinstance(session, Session)
    for name in MEMBERS:
        want = getattr(Session, name)
        if isinstance(want, property):
            assert not callable(getattr(session, name)), name  # read as a value
            continue
        got = inspect.signature(getattr(type(session), name))
        assert list(got.parameters) == list(inspect.signature(want).parameters), name
        assert [p.default for p in got.parameters.values()] == \
               [p.default for p in inspect.signature(want).parameters.values()], name
    assert session.window_index == 0 and session.frames_pushed == 0 and session.cfg.num_scale_frames == 2
    assert session.device.type == "cpu" and session.stats() is None


@pytest.mark.parametrize("kind", ["plain", "long"])
def test_submit_returns_what_results_takes(sessions, kind, fixtures):
    import numpy as np

    session = sessions[kind]
    session.reset()
    images = np.load(fixtures / "reference_kf1.npz")["images"]
    first, second = session.submit(images[0]), session.submit(images[1])
    assert [r.frame_index for r in session.results(second)] == [0, 1]  # the scale step, at the second frame
    assert session.results(first) == []  # taken already (in submission order): the first frame's were none
    session.reset()


def test_stream_exports_the_errors_the_node_layers_catch():
    from lingbot_map_ros.cache import attention, pages
    from lingbot_map_ros.stream import errors, session

    assert stream.CacheFullError is pages.CacheFullError and stream.CacheError is pages.CacheError
    assert stream.SessionError is session.SessionError is errors.SessionError
    assert stream.FrameMismatchError is session.FrameMismatchError
    assert issubclass(stream.FrameMismatchError, stream.SessionError)
    assert issubclass(stream.InvalidFrameError, ValueError) and issubclass(stream.CacheFullError, stream.CacheError)
    assert stream.BackendUnavailable is attention.BackendUnavailable
    assert stream.StreamingSession is StreamingSession and stream.LongStreamSession is LongStreamSession
    assert stream.FrameResult is session.FrameResult
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        stream.Nothing  # noqa: B018
