"""The fleet journal: what happened to each node, when and why, kept in memory for operators."""

from __future__ import annotations

from qiip_core.journal._journal import JOURNAL_ENTRIES, Journal, JournalEntry

__all__ = ["JOURNAL_ENTRIES", "Journal", "JournalEntry"]
