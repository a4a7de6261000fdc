"""What an error says, on one line: for a log line, or a one-line message to a user."""

from __future__ import annotations


def one_line(error: BaseException | None, limit: int | None = None) -> str:
    """`error`'s text with every run of whitespace (newlines too) made one space, cut at `limit` characters; the
    name of its type if it says nothing."""
    return " ".join(str(error).split())[:limit] or type(error).__name__
