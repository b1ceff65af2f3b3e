"""A JSON text read one value at a time, so that a large document is never one tree of Python
objects. No I/O.

``json.loads`` of valid JSON can hold 30 times the text: ``[0]`` is 4 bytes of text and about
100 bytes of objects, ``{"a":0}`` 8 and 200. `Reader` opens the containers its caller names
(`Reader.members`, `Reader.items`) and leaves every other value to json's C scanner, reading a
container from a slice of at most ``limit`` characters: what parsing one value holds is bounded
by that slice, and what the caller keeps of it is the caller's business.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Container, Iterator
from typing import Any, NoReturn

from .jsoncheck import fail, reject_constant, show, unique_pairs

__all__ = ["Reader"]

_SPACES = " \t\n\r"
_SPACE = re.compile(f"[{_SPACES}]*")
_VALUE_STARTS = '{["-0123456789tfn'
_FIRST_SLICE = 4096  # most small values fit: a longer slice only for those that do not


class Reader:
    """Walks ``text``, a JSON document named ``name`` in errors; `pos` is where it has got."""

    def __init__(self, text: str, name: str) -> None:
        self.text = text
        self.name = name
        self.pos = 0
        decoder = json.JSONDecoder(object_pairs_hook=unique_pairs, parse_constant=reject_constant)
        self._scan: Callable[[str, int], tuple[Any, int]] = decoder.scan_once  # type: ignore[attr-defined]

    def peek(self) -> str:
        """The first character of the next value ("" at the end)."""
        char = self.text[self.pos : self.pos + 1]
        if char and char in _SPACES:
            match = _SPACE.match(self.text, self.pos)
            self.pos = self.pos if match is None else match.end()
            char = self.text[self.pos : self.pos + 1]
        return char

    def members(self, where: str, into: Container[str] | None = None) -> Iterator[str]:
        """The keys of the object that comes next, each in turn; the caller reads each one's
        value (with `value`, or a walk of its own) before asking for the next key. A key is
        checked for a second appearance in ``into`` if given (the caller's own dict of what it
        has read, which costs nothing more), else in a set of the keys so far."""
        self._open("{", where, "a JSON object")
        keys: set[str] = set()
        seen = keys if into is None else into
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            if self.peek() != '"':
                self._syntax("Expecting property name enclosed in double quotes")
            key: str = self._scalar()
            if key in seen:
                fail(f"not a valid {self.name}: key {show(key)} appears twice in one object")
            if into is None:
                keys.add(key)
            if self.peek() != ":":
                self._syntax("Expecting ':' delimiter")
            self.pos += 1
            yield key
            if not self._next("}"):
                return

    def items(self, where: str) -> Iterator[int]:
        """The positions of the items of the list that comes next, as `members` does keys."""
        self._open("[", where, "a JSON list")
        if self.peek() == "]":
            self.pos += 1
            return
        position = 0
        while True:
            yield position
            position += 1
            if not self._next("]"):
                return

    def small(self) -> Any | None:
        """The next value if it is a container whose text fits in a short slice (one scan),
        else None, and `pos` is unchanged: the caller walks it."""
        start = self.pos
        if self.peek() not in ("{", "["):
            return None
        try:
            found, end = self._scan(self.text[self.pos : self.pos + _FIRST_SLICE], 0)
        except (json.JSONDecodeError, StopIteration):
            self.pos = start
            return None
        self.pos += end
        return found

    def value(self, where: str, limit: int) -> Any:
        """The next value: a string or a number whatever its length (it costs about its
        text), an object or a list only if its text fits in ``limit`` characters."""
        if self.peek() not in ("{", "["):
            return self._scalar()
        start = self.pos
        for size in (_FIRST_SLICE, limit) if limit > _FIRST_SLICE else (limit,):
            piece = self.text[start : start + size]
            try:
                found, end = self._scan(piece, 0)
            except (json.JSONDecodeError, StopIteration) as e:
                if start + size < len(self.text):
                    continue  # cut short by the slice, or wrong: a longer slice tells
                if isinstance(e, StopIteration):
                    self._syntax("Expecting value", start + e.value)
                self._syntax(e.msg, start + e.pos)
            self.pos = start + end
            return found
        fail(f"{where}: more than {limit} bytes of JSON (or not valid JSON)")

    def end(self) -> None:
        if self.peek():
            self._syntax("Extra data")

    def _scalar(self) -> Any:
        """A string, number, true, false or null at `pos`."""
        try:
            found, self.pos = self._scan(self.text, self.pos)
        except StopIteration as e:
            self._syntax("Expecting value", e.value)
        except json.JSONDecodeError as e:
            self._syntax(e.msg, e.pos)
        return found

    def _open(self, bracket: str, where: str, kind: str) -> None:
        found = self.peek()
        if found != bracket:
            if not found or found not in _VALUE_STARTS:
                self._syntax("Expecting value")
            fail(f"{where}: expected {kind}, got {show(self.text[self.pos : self.pos + 77])}")
        self.pos += 1

    def _next(self, close: str) -> bool:
        """Past a comma (True: another member or item follows) or the closing bracket."""
        found = self.peek()
        self.pos += 1
        if found == ",":
            return True
        if found != close:
            self._syntax(f"Expecting ',' delimiter or '{close}'", self.pos - 1)
        return False

    def _syntax(self, message: str, at: int | None = None) -> NoReturn:
        error = json.JSONDecodeError(message, self.text, self.pos if at is None else at)
        fail(f"{self.name} is not valid JSON (truncated or garbled?): {error}")
