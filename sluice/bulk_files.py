"""The file side of `sluice bulk`: its input lines, what a resume skips, the ordered
writer of results, and the run's summary. No engine here (`sluice/bulk_run.py` runs it).

Lines are parsed and their output and error lines formatted by
`consumers/batches/lines.py`, the Batch API's own code, so a bulk run's file equals a
batch's output file line for line (ids and timestamps aside). Unlike a batch, a line with
a structural fault (bad JSON, a duplicate `custom_id`, a wrong url or method, a model
not served) does not fail the file: it gets an error line that carries its line number.

Resume keys: a line that ran is done when its `custom_id` is in the output; a line with
a structural fault, which may have no usable `custom_id`, when an error line names its
line number (`error.line`, numbered from 1 as the Batch API's errors are).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sluice.api.served import ServedModel
from sluice.consumers.batches.lines import MAX_CUSTOM_ID, line_error, parse_file, unrun_line

# a single line may hold what text.splitlines() splits further (U+2028 in a string): it
# then fails as its fragments would in a batch, rather than as one "too many" error
_NO_LINE_LIMIT = 1 << 31


@dataclass(frozen=True, slots=True)
class InputLine:
    """One non-blank line of the input: a request to run, or a structural error."""

    number: int  # 1-based, blank lines counted (an editor's line number)
    custom_id: str | None  # None when the line has no usable one
    body: dict[str, Any] | None
    error: dict[str, Any] | None = None  # `line_error`'s entry: code, message, param, line

    def error_line(self) -> str:
        """The output line of a structural error: the Batch API's unrun line, plus the
        error's param and line number (what a resume keys it by)."""
        assert self.error is not None
        code, message = self.error["code"], self.error["message"]
        obj = json.loads(unrun_line(self.custom_id or "", code, message))
        obj["custom_id"] = self.custom_id
        obj["error"].update(param=self.error.get("param"), line=self.number)
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))  # as lines.py writes


def read_input(content: bytes, endpoint: str, models: Mapping[str, ServedModel]) -> list[InputLine]:
    """Every non-blank line, each checked on its own by the Batch API's `parse_file`;
    a `custom_id` already claimed by an earlier line is a duplicate, as there."""
    lines: list[InputLine] = []
    seen: set[str] = set()
    for i, raw in enumerate(content.splitlines()):
        if not raw.strip():
            continue
        parsed, errors = parse_file(raw, endpoint, models, _NO_LINE_LIMIT)
        custom_id = parsed[0].custom_id if parsed else custom_id_of(raw)
        if custom_id is not None and custom_id in seen:
            message = f"custom_id {custom_id!r} is used by an earlier line"
            error = line_error(i, "duplicate_custom_id", message, "custom_id")
            lines.append(InputLine(i + 1, custom_id, None, error))
            continue
        if custom_id is not None:
            seen.add(custom_id)
        if errors:
            lines.append(InputLine(i + 1, custom_id, None, {**errors[0], "line": i + 1}))
        else:
            lines.append(InputLine(i + 1, custom_id, parsed[0].body))
    return lines


def custom_id_of(raw: bytes) -> str | None:
    """The custom_id of a line that failed a check, when it has a usable one."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    if isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return custom_id
    return None


def first_url(content: bytes) -> str | None:
    """The `url` of the first line that names one (the endpoint a file is for)."""
    for raw in content.splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("url"), str):
            return str(obj["url"])
    return None


# -- resume --------------------------------------------------------------------------------
@dataclass(slots=True)
class Done:
    """What earlier runs wrote: the custom_ids of lines that ran, the line numbers of
    structural errors."""

    custom_ids: set[str] = field(default_factory=set)
    line_numbers: set[int] = field(default_factory=set)
    lines: int = 0

    def has(self, line: InputLine) -> bool:
        if line.error is not None:
            return line.number in self.line_numbers
        return line.custom_id in self.custom_ids


def truncate_to_last_line(path: Path) -> int:
    """Cut a torn last line (a run killed mid-write) off `path`; the bytes cut."""
    if not path.exists():
        return 0
    with path.open("rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # back to just after the last newline, a block at a time
            start = max(0, end - 65536)
            fh.seek(start)
            cut = fh.read(end - start).rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        fh.truncate(end)
    return size - end


def read_done(paths: list[Path], done: Done | None = None) -> Done:
    """Truncate each file to its last complete line, then collect what its lines did."""
    done = done if done is not None else Done()
    for path in paths:
        truncate_to_last_line(path)
        if not path.exists():
            continue
        with path.open("rb") as fh:
            for raw in fh:
                _add_done(done, raw)
    return done


def _add_done(done: Done, raw: bytes) -> None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return  # not one of ours; its line runs again
    if not isinstance(obj, dict):
        return
    done.lines += 1
    error = obj.get("error")
    if isinstance(error, dict) and isinstance(error.get("line"), int):
        done.line_numbers.add(error["line"])
    elif isinstance(obj.get("custom_id"), str):
        done.custom_ids.add(obj["custom_id"])


# -- the ordered writer ------------------------------------------------------------------------
class OrderedWriter:
    """Writes results in input order: a result waits until every earlier line's is written.

    Why input order (a reorder buffer) rather than completion order: the output then
    reads beside the input line for line, and a killed run leaves a prefix of it. A
    resume still goes by custom_id (`Done`), so the out-of-order tail that an
    interrupted run flushes (`flush_all`) is resumed just as well.

    Each write is flushed to the OS at once: a kill -9 loses at most a torn last line,
    which a resume cuts off.
    """

    def __init__(self, output: IO[str], errors: IO[str] | None = None) -> None:
        self._output = output
        self._errors = errors
        self._waiting: dict[int, tuple[str, bool]] = {}
        self.next_seq = 0  # the first line not written yet
        self.ok = 0
        self.failed = 0

    @property
    def buffered(self) -> int:
        """Results done but waiting for an earlier line."""
        return len(self._waiting)

    def put(self, seq: int, line: str, ok: bool) -> None:
        """The result of line `seq` (0, 1, 2, … over the lines this run does)."""
        self._waiting[seq] = (line, ok)
        if seq != self.next_seq:
            return
        while self.next_seq in self._waiting:
            self._write(*self._waiting.pop(self.next_seq))
            self.next_seq += 1
        self._flush()

    def flush_all(self) -> int:
        """Write what is waiting, out of order (an interrupted run); how many."""
        count = len(self._waiting)
        for seq in sorted(self._waiting):
            self._write(*self._waiting.pop(seq))
        self._flush()
        return count

    def _write(self, line: str, ok: bool) -> None:
        target = self._output if ok or self._errors is None else self._errors
        target.write(line + "\n")
        if ok:
            self.ok += 1
        else:
            self.failed += 1

    def _flush(self) -> None:
        self._output.flush()
        if self._errors is not None:
            self._errors.flush()


# -- the summary ---------------------------------------------------------------------------
@dataclass(slots=True)
class Summary:
    """A run's figures: `--json` prints them, the progress bar shows them as they grow."""

    lines: int  # non-blank input lines
    skipped: int = 0  # done by an earlier run (--resume)
    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None

    @property
    def done(self) -> int:
        return self.ok + self.failed

    @property
    def seconds(self) -> float:
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return max(0.0, end - self.started_at)

    @property
    def tokens_per_s(self) -> float:
        seconds = self.seconds
        return self.output_tokens / seconds if seconds > 0 else 0.0

    def describe(self) -> str:
        """The figures after the bar: `2 failed · 1,234.5 tok/s`."""
        return f"{self.failed} failed · {self.tokens_per_s:,.1f} tok/s"

    def as_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "skipped": self.skipped,
            "ok": self.ok,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
            "output_tokens": self.output_tokens,
            "tokens_per_s": round(self.tokens_per_s, 1),
        }
