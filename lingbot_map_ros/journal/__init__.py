"""The keyframe journal: the model's state kept on disk as the frames it stored.

``format`` (the file: header, checksummed records), ``writer`` (appends off the inference
thread, pauses and recovers, compacts), ``recorder`` (``JournalRecorder``: the journal of a
session, observing it), ``rebuild`` (replay a journal into a fresh session), ``identity``
(what a journal depends on), ``state_dir`` (a state directory at start, saved sessions).
No ROS here.
"""
from .format import JournalError, Record, scan
from .identity import journal_identity
from .resume import JournalMismatch, Rebuilt, rebuild
from .recorder import JournalRecorder
from .state_dir import JOURNAL_NAME, Opened, load_session, open_state_directory, save_session, set_aside
from .writer import JournalStatus, JournalWriter

__all__ = ["JOURNAL_NAME", "JournalError", "JournalMismatch", "JournalStatus", "JournalWriter", "JournalRecorder",
           "Opened", "Rebuilt", "Record", "journal_identity", "load_session", "open_state_directory", "rebuild",
           "save_session", "scan", "set_aside"]
