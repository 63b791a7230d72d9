"""Files a user hands the project (a preset, a strategy file, an adapter's JSON, a checkpoint's state), read as data.

The sandbox treats the model's code as hostile; these are the same walls for a user's files, which are shared and
downloaded like notebooks. Before a byte is read, the path is opened without blocking and `fstat` says what it is:
a FIFO (which would hang the open), a device such as /dev/zero (endless), a terminal, a socket or a folder is refused,
and so is a regular file above the limit its caller names. Parsing has limits too: YAML with no aliases (PyYAML
expands them without bound) and nesting no deeper than MAX_DEPTH; JSON nesting no deeper than MAX_DEPTH. Every
refusal is a FileRefused: one line that names the file and what is wrong, for the command's exit status 2.

Writing is the other half: write_new() creates a file that did not exist (O_EXCL, never through a symbolic link).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

MAX_DEPTH = 32  # nesting of a preset's or a JSON file's values; ours go 3 deep
PRESET_BYTES = 1 << 20  # a preset is a page of options
STRATEGY_BYTES = 4 << 20  # a strategy file (the archive's files keep up to 2 MB of code as a string)
JSON_BYTES = 16 << 20  # an adapter_config.json, trainer_state.json, index.json, merge_report.json
KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


class FileRefused(ValueError):
    """A user's file that is not what it should be, in one line."""


def shorten(text: str, limit: int = 300) -> str:
    """`text` as one line of at most `limit` characters: whitespace collapsed, and a longer text cut at the last word
    boundary before the limit with "..." (mid-word only when a single word fills more than half the line: a path)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - 3)]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "..."


def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MB" if n >= 1 << 20 else f"{n / 1024:.0f} kB" if n >= 1024 else f"{n} bytes"


def read_bytes(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes; FileRefused for anything else (never blocks, never reads
    more than limit + 1 bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise FileRefused(f"cannot read {what} {path}: cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise FileRefused(f"cannot read {what} {path}: {kind}, not a regular file")
        if info.st_size > limit:
            raise FileRefused(f"cannot read {what} {path}: {_size(info.st_size)}, above the {_size(limit)} such a file may have")
        chunks, left = [], limit + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as exc:
                raise FileRefused(f"cannot read {what} {path}: cannot be read ({exc.strerror or exc})") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # it grew while read (/proc files report size 0 and are read the same way)
            raise FileRefused(f"cannot read {what} {path}: more than the {_size(limit)} such a file may have")
        return data
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int, what: str = "file") -> str:
    """read_bytes() decoded as UTF-8 (a BOM dropped)."""
    try:
        return read_bytes(path, limit, what).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"cannot read {what} {path}: not UTF-8 text (byte {exc.start})") from None


def _depth(value, limit: int, depth: int = 0) -> int:
    """The nesting depth of parsed JSON/YAML values, stopping as soon as it passes `limit` (iterative)."""
    stack, deepest = [(value, depth)], depth
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


def read_json(path: str | os.PathLike, limit: int = JSON_BYTES, what: str = "file"):
    """A JSON file's value: read with read_text, parsed with nesting bounded by MAX_DEPTH (deeper nesting would reach
    Python's recursion limit inside the parser)."""
    text = read_text(path, limit, what)
    depth = 0
    for char in text:  # brackets inside strings count too: a bound on the parser's recursion, not a parse
        if char in "[{":
            depth += 1
            if depth > MAX_DEPTH * 4:
                raise FileRefused(f"cannot read {what} {path}: nested deeper than {MAX_DEPTH * 4} levels")
        elif char in "]}":
            depth -= 1
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise FileRefused(f"cannot read {what} {path}: not valid JSON ({shorten(exc, 120)})") from None
    if _depth(value, MAX_DEPTH) > MAX_DEPTH:
        raise FileRefused(f"cannot read {what} {path}: nested deeper than {MAX_DEPTH} levels")
    return value


MAX_DIGITS = 100  # of an integer in a preset: Python refuses to convert one of 4,300 digits, with a traceback


def read_yaml(path: str | os.PathLike, limit: int = PRESET_BYTES, what: str = "config"):
    """A YAML file's value, parsed by PyYAML's safe loader (no code runs) with no anchors or aliases (each alias may
    expand to a copy of a whole tree: 10^9 leaves from a few lines), nesting bounded by MAX_DEPTH, integers of at most
    MAX_DIGITS digits, and no key given twice in one mapping (PyYAML keeps the last, unsaid)."""
    import yaml

    text = read_text(path, limit, what)

    def refuse(node, said: str):
        raise FileRefused(f"cannot read {what} {path}: line {node.start_mark.line + 1}: {said}")

    class BoundedLoader(yaml.SafeLoader):
        depth = 0

        def construct_yaml_int(self, node):
            digits = sum(c.isalnum() for c in str(node.value))
            if digits > MAX_DIGITS:
                refuse(node, f"an integer of {digits:,} digits (at most {MAX_DIGITS})")
            return super().construct_yaml_int(node)

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key, _ in node.value:
                    name = key.value if isinstance(key, yaml.ScalarNode) else None
                    if name is not None and name in seen:
                        refuse(key, f"the key {shorten(name, 60)} is given twice (YAML would keep the last, unsaid): "
                               "give it once")  # fmt: skip
                    seen.add(name)
            return super().construct_mapping(node, deep=deep)

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise FileRefused(f"cannot read {what} {path}: line {mark.line + 1}: YAML aliases (*name) are not accepted "
                                  "in a preset: write the value out")  # fmt: skip
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise FileRefused(f"cannot read {what} {path}: nested deeper than {MAX_DEPTH} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise FileRefused(f"cannot read {what} {path}: {shorten(exc, 300)}") from None
    except RecursionError:
        raise FileRefused(f"cannot read {what} {path}: nested too deeply") from None
    finally:
        loader.dispose()


def name_problem(path: str | os.PathLike, room: int = 64) -> str | None:
    """Why a file or folder cannot be made at `path` on this system (None: it can): a part of its name longer than the
    file system allows (NAME_MAX: 255 bytes on Linux), or the whole path, with `room` bytes for the names written
    inside it, longer than PATH_MAX. Asked before anything is written, so the answer is one line, not an OSError from
    deep in a library."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    existing = path
    while existing != existing.parent:
        try:
            if existing.exists():
                break
        except OSError:  # ENAMETOOLONG: the name said below
            pass
        existing = existing.parent

    def limit(name: str, default: int) -> int:
        try:
            return os.pathconf(existing if existing.is_dir() else existing.parent, name)
        except (OSError, ValueError):
            return default

    most = limit("PC_NAME_MAX", 255)
    for part in path.parts:
        if len(os.fsencode(part)) > most:
            return (f"{shorten(part, 40)} is a name of {len(os.fsencode(part))} bytes, longer than this file system "
                    f"allows ({most}): give a shorter one")  # fmt: skip
    longest = limit("PC_PATH_MAX", 4096)
    if len(os.fsencode(str(path))) + room > longest:
        return (f"{shorten(str(path), 60)} is a path of {len(os.fsencode(str(path)))} bytes, and with the names written "
                f"inside it longer than this system allows ({longest}): give a shorter one")  # fmt: skip
    return None


FULL = 64 << 20  # free bytes below which a failed write is said as a full disk


def write_failure(error: BaseException, folder: str | os.PathLike) -> str:
    """A write that failed, in a few words: "no space left on device" when the disk holding `folder` is full (ENOSPC
    anywhere in the error's chain, or its message, or less than FULL bytes left after a write failed: torch's writer
    says only `[enforce fail at inline_container.cc] . unexpected pos`), else the error as one line. Asked before
    what was written is removed."""
    import shutil

    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    said = shorten(f"{type(error).__name__}: {error}", 200)
    if any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) for e in chain):
        return f"no space left on device ({said})"
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return said
    if free < FULL:
        return f"no space left on device ({_size(free)} free on the disk holding {folder})"
    return said


def write_new(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Create `path` with `data`: it must not exist (a file or a link of the same name, dangling or not, is never
    written through). FileExistsError otherwise."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def open_append(path: Path):
    """A text file opened for appending, never through a symbolic link (OSError ELOOP for a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


def is_link_loop(exc: OSError) -> bool:
    """The error O_NOFOLLOW gives for a symbolic link."""
    return exc.errno == errno.ELOOP
