"""Bounded parsing of the YAML and JSON files users hand to Stratagem.

Resource specs, strategies and checkpoint ``meta.json`` files come from people (and from
whoever can write next to them). ``yaml.safe_load`` already refuses Python tags, but it
expands aliases without limit (a few lines of ``&a [*b, *b, ...]`` "billion laughs" become
gigabytes once the values are turned into strings), and both YAML and JSON recurse once per
nesting level, so a file nested 100,000 deep ends in a RecursionError traceback. Here:

* YAML aliases (``*name``) are refused: every value is written out where it is used;
* a key written twice in one mapping is refused (YAML would keep the last one silently);
* nesting deeper than :data:`MAX_DEPTH` is refused, before any recursion gets deep;
* files larger than :data:`MAX_BYTES` are refused;
* every failure is the caller's :class:`StratagemError` subclass with a fix.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionStartEvent

from stratagem.errors import StratagemError

MAX_DEPTH = 64  # deeper than any spec, strategy or checkpoint metadata needs
MAX_BYTES = 16 << 20


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and deep nesting while composing the node tree."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} is not allowed", event.start_mark)
        nested = self.check_event(CollectionStartEvent)
        if nested:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            if nested:
                self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it itself
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {short(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _check_size(text: str | bytes, where: str, error: type[StratagemError]) -> None:
    if len(text) > MAX_BYTES:
        raise error(f"file too large ({len(text)} bytes, at most {MAX_BYTES})", where=where,
                    fix="this is not a Stratagem file, or it was damaged")


def load_yaml(text: str, where: str, error: type[StratagemError] = StratagemError,
              fix: str = "check indentation and that every list item starts with '- '"
              ) -> Any:
    """Parse ``text`` (YAML, or JSON: a subset) into plain Python values, within bounds."""
    _check_size(text, where, error)
    if json_depth(text) > MAX_DEPTH:  # flow style ([[[...): refused before the scanner,
        # whose look-ahead over open brackets is quadratic
        raise error(f"nested deeper than {MAX_DEPTH} levels", where=where,
                    fix=f"flatten the file: it may nest at most {MAX_DEPTH} levels")
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if "duplicate key" in problem:
            fix = "write each key once in a mapping"
        elif "alias" in problem:
            fix = "write the value out in full: YAML aliases (*name) are not supported"
        elif "nested deeper" in problem:
            fix = f"flatten the file: it may nest at most {MAX_DEPTH} levels"
        raise error(f"malformed YAML{at}: {problem}", where=where, fix=fix) from None
    except (ValueError, OverflowError, RecursionError) as exc:  # e.g. a 5,000-digit integer
        raise error(f"unreadable value: {exc}", where=where, fix=fix) from None


def load_json(text: str | bytes, where: str, error: type[StratagemError] = StratagemError,
              fix: str = "restore the file from a backup") -> Any:
    """Parse JSON ``text`` within :data:`MAX_BYTES` and :data:`MAX_DEPTH`."""
    _check_size(text, where, error)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"not UTF-8 text: {exc}", where=where, fix=fix) from None
    if json_depth(text) > MAX_DEPTH:
        raise error(f"nested deeper than {MAX_DEPTH} levels", where=where, fix=fix)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise error(f"malformed JSON: {exc}", where=where, fix=fix) from None


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about user input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} chars)"


def json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of ``text`` (brackets inside double-quoted strings
    ignored), or ``MAX_DEPTH + 1`` as soon as it is known to be deeper."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return depth
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest
