"""The keyframe journal: the model's state kept on disk as the frames it stored.

``format`` (the file: header, checksummed records), ``writer`` (appends off the inference
thread, pauses and recovers, compacts), ``recorder`` (``JournaledSession``: a session
that journals itself), ``rebuild`` (replay a journal into a fresh session), ``identity``
(what a journal depends on). No ROS here.
"""
from .format import JournalError, Record, scan
from .identity import journal_identity
from .resume import JournalMismatch, Rebuilt, rebuild
from .recorder import JournaledSession
from .writer import JournalStatus, JournalWriter

JOURNAL_NAME = "journal.lbj"  # the journal's file name inside a state directory or a saved session

__all__ = ["JOURNAL_NAME", "JournalError", "JournalMismatch", "JournalStatus", "JournalWriter", "JournaledSession",
           "Rebuilt", "Record", "journal_identity", "rebuild", "scan"]
