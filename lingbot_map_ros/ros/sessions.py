"""The node's keyframe journal over ROS: start-up resume, ~/save_session, ~/load_session and
the "journal" entry of /diagnostics (the logic lives in ``runtime.journaling``).

- Start-up (``open_journals``): every camera's session gets its journal recorder and, when its
  state directory holds a journal (or ``load_session`` names a saved session), is rebuilt
  before the node subscribes; ~/status says "resuming k of n" meanwhile.
- ``~/save_session``: every camera's journal into one saved session folder, written on the
  service thread (a slow disk holds up neither frames nor other services).
- ``~/load_session``: every camera's state replaced by the saved session's, on the
  inference thread (frames that arrive meanwhile are dropped as stale and counted). All
  cameras' journals are checked before any camera's state changes.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from diagnostic_msgs.msg import DiagnosticStatus

from lingbot_map_ros.srv import LoadSession, SaveSession

from ..journal import JournalError
from ..runtime.frames import StatusFields
from ..runtime.journaling import (Resumed, SessionError, camera_folder, check_saved, open_camera_journal,
                                  save_sessions, session_folder)
from .common import SERVICE_QOS, diag


def open_journals(channels: dict, sessions: dict, camera_settings: dict) -> tuple[dict, dict[str, Resumed | None]]:
    """Each camera's journal recorder (None: journaling and saved sessions off) observing its
    session, rebuilt from its journal or saved session; and what was rebuilt per camera.
    SessionError / OSError / JournalError when a requested session cannot be loaded."""
    journals, resumed = {}, {}
    for name, channel in channels.items():
        def progress(k: int, n: int, outputs=channel.outputs) -> None:
            outputs.publish_status(StatusFields(state=0, state_text=f"resuming {k} of {n}"), None)
        journals[name], resumed[name] = open_camera_journal(sessions[name], camera_settings[name], name, progress)
        if resumed[name] is not None:
            r = resumed[name]
            _log(channel.log, not (r.refused or r.stop),
                 f"journal set aside as {r.set_aside}: {r.refused}; a new journal starts" if r.refused
                 else r.describe())
    return journals, resumed


class SessionServices:
    """~/save_session and ~/load_session (one call for every camera of ``channels``: name ->
    ``CameraChannel``, filled by the node); ``settings()``: the node's settings in force."""

    def __init__(self, channels: dict, settings: Callable[[], Any], log, service_node, prefix: str, group) -> None:
        self.channels, self.settings, self.log = channels, settings, log
        self._lock = threading.Lock()  # one save or load at a time
        self.handles = [
            service_node.create_service(SaveSession, f"{prefix}/save_session", self.save, qos_profile=SERVICE_QOS,
                                        callback_group=group),
            service_node.create_service(LoadSession, f"{prefix}/load_session", self.load, qos_profile=SERVICE_QOS,
                                        callback_group=group),
        ]

    def _serve(self, service: str, what: str, response, body: Callable[[Any], str]):
        """One save or load at a time: ``body(response)`` fills the response and returns the
        message of a success; a refusal (SessionError, JournalError, OSError) answers
        "not <what>: <reason>" and changes nothing it had not changed already. Logged once."""
        timeout = self.settings().service_timeout
        response.success = False
        if not self._lock.acquire(timeout=timeout):
            response.message = (f"another ~/save_session or ~/load_session is still running after {timeout:.1f} s; "
                                 "nothing done")
        else:
            try:
                response.message = body(response)
                response.success = True
            except (SessionError, JournalError, OSError) as exc:
                response.message = f"not {what}: {_reason(exc)}"
            finally:
                self._lock.release()
        _log(self.log, response.success, f"~/{service}: {response.message}")
        return response

    def save(self, request, response):
        def body(response) -> str:
            journals = {name: ch.engine.journal for name, ch in self.channels.items()}
            folder = session_folder(request.directory, self.settings().output_directory)
            maps = {name: ch.engine.seq.map_journal for name, ch in self.channels.items()}
            loops = {name: ch.engine.loop for name, ch in self.channels.items()}
            response.bytes = save_sessions(journals, folder, maps, loops)
            response.path = str(folder)
            cameras = f" ({len(journals)} cameras)" if len(journals) > 1 else ""
            return f"saved the session{cameras} in {folder} ({response.bytes / 2**20:.1f} MiB)"
        return self._serve("save_session", "saved", response, body)

    def load(self, request, response):
        def body(response) -> str:
            folder = session_folder(request.directory, self.settings().output_directory, default_name=False)
            if not folder.is_dir():
                raise SessionError(f"no saved session at {folder} (no such folder)")
            channels = self.channels
            for name, channel in channels.items():  # every camera's, before any state changes
                try:
                    check_saved(channel.engine.journal, camera_folder(folder, name), channel.settings.image_width)
                except SessionError as exc:
                    raise SessionError(f"camera {name}: {exc}" if name else str(exc)) from None
            done: list[Resumed] = []
            for name, channel in channels.items():
                ok, resumed, error = channel.run("load_session", lambda c=channel, n=name:
                                                 c.engine.commands.load_session(camera_folder(folder, n)))
                if not ok:
                    loaded = f" ({len(done)} camera(s) before it already loaded)" if done else ""
                    raise SessionError(f"camera {name}: {error}{loaded}" if name else error)
                done.append(resumed)
            response.frames_replayed = sum(r.frames for r in done)
            response.next_frame = done[0].next_frame + 1
            response.seconds = sum(r.seconds for r in done)
            return "; ".join(f"{n}: {r.describe()}" if n else r.describe() for n, r in zip(channels, done))
        return self._serve("load_session", "loaded", response, body)


def journal_diag(label: str, engine) -> DiagnosticStatus | None:
    """The "journal" entry of a camera: WARN while journaling is paused (disk full, not writable,
    too slow) or when a journal found at start was set aside; None without sessions."""
    journal, resumed = engine.journal, engine.commands.resumed
    if journal is None:
        return None
    values: dict[str, Any] = {}
    level, message = DiagnosticStatus.OK, "off (state_directory empty): saved sessions can be loaded"
    if journal.writer is not None:
        st = journal.writer.status()
        values = {"path": st.path, "state": st.state, "records in the segment": st.records,
                  "file size (MiB)": f"{st.file_bytes / 2**20:.1f}", "written (MiB)": f"{st.bytes_written / 2**20:.1f}",
                  "queued records": st.queued, "pauses": st.pauses, "rewrites": st.rewrites}
        if st.state == "paused":
            level, message = DiagnosticStatus.WARN, f"paused: {st.reason}; inference goes on"
        else:
            message = f"{st.state}: {st.records} records, {st.file_bytes / 2**20:.1f} MiB"
        map_journal = engine.seq.map_journal
        if map_journal is not None:
            ms = map_journal.status()
            values.update({"map journal": ms.path, "map journal state": ms.state,
                           "map journal file size (MiB)": f"{ms.file_bytes / 2**20:.1f}",
                           "map journal written (MiB)": f"{ms.bytes_written / 2**20:.1f}"})
            if ms.state == "paused" and level == DiagnosticStatus.OK:
                level, message = DiagnosticStatus.WARN, f"map journal paused: {ms.reason}; inference goes on"
    restored = engine.seq.restored
    if restored is not None:
        values["map and path at the last resume"] = (f"not restored: {restored.note}" if restored.note and not
                                                     restored.records else f"{restored.points} points, "
                                                     f"{restored.poses} poses" + (f" ({restored.note})"
                                                                                  if restored.note else ""))
    if resumed is not None:
        values["at start" if resumed.source == "journal" else "last load"] = (
            f"set aside as {resumed.set_aside}: {resumed.refused}" if resumed.refused else resumed.describe())
        if resumed.refused and level == DiagnosticStatus.OK:
            level, message = DiagnosticStatus.WARN, f"{message}; a journal found at start was set aside"
    return diag(f"{label}: journal", level, message, values)


def _log(logger, ok: bool, text: str) -> None:
    """INFO when ``ok``, else WARN (rclpy refuses two severities from one call site)."""
    if ok:
        logger.info(text)
    else:
        logger.warning(text)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    return str(exc)


__all__ = ["SessionServices", "journal_diag", "open_journals"]
