"""How one copy of a folder reaches one host's node-local path, for ``broadcast``.

Transports (``TRANSPORTS``, keyed by the CLI ``--transport`` kind) carry out one copy:
  - local: host H's node-local path is ``dest`` with ``{host}`` replaced, on this machine (tests,
    and a demonstration of the tree without a cluster);
  - rsync: ``rsync -a --delete`` over ssh, pushed by the source host;
  - tar: ``tar -c | ssh DST tar -x``, run on the source host;
  - tar with ``compress`` (``ArchiveTransport``): one tar.zst archive written once on this
    machine (``archive``), sent as it is, ``cat ARCHIVE | ssh DST 'tee | zstd -d | tar -x'``;
    each host keeps the archive beside its copy (``ARCHIVE_SUFFIX``) to serve the next hosts.
The remote transports pass ``-F SSH_CONFIG`` to every ssh they start, the ssh a source host runs
to reach the next host included, so that file must sit at the same path on every host.
Invariants: ``dest`` is absolute and normalized for every transport (no ``..``, not ``/``) and
``{host}`` is replaced only by a validated host name, so no copy lands outside its path. A copy
lands under a temp sibling (``.partial``) and is renamed onto its final path only when complete,
with a ``MARKER`` file inside naming its source; an existing final path is replaced only when
it carries that marker (a copy goodput made), anything else there is refused and left as it
is. So a transport deletes only its own partial copies and its own earlier copies (and, with
``compress``, the archive at its own path beside its copy). Local
commands are argv lists and every remote argument is ``shlex.quote``d (ssh hands the remote
shell one string). ``fix_venv_prefix`` points a copied virtual environment at its new path,
reading and writing only the copy's own files (never through a link: ``io.read_inside``,
``io.write_inside``); ``check_venv_links`` refuses, beforehand, a venv whose files to rewrite lie
behind a link, which each copy would keep.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Protocol

from goodput.errors import GoodputError
from goodput.io import (
    DIR_MODE,
    SMALL_FILE_BYTES,
    first_link,
    link_in_the_way,
    open_regular,
    read_inside,
    special_entries,
    write_inside,
)
from goodput.launch.env import check_host

COMMAND_TIMEOUT_S = 3600.0
MARKER = ".goodput-broadcast"  # in every finished copy: its source, as one line of JSON
REFUSED = "goodput-broadcast-refused:"  # what the remote guard prints before exit 3
ARCHIVE_SUFFIX = ".goodput.tar.zst"  # beside a host's copy, while it serves others (--compress)


class Transport(Protocol):
    # True when ``copy`` points a copied venv at its new path itself; else ``broadcast``
    # sends a prepared copy.
    rewrites_venv_prefix: bool

    def path(self, host: str) -> str:
        """The node-local path of the copy on ``host``."""
        ...

    def copy(self, origin: Path, src_host: str | None, dst_host: str, marker: str) -> None:
        """Copy ``origin`` (``src_host`` None) or ``src_host``'s copy to ``dst_host``, with
        ``marker`` as the text of its ``MARKER`` file. A final path that is not a copy goodput
        made is refused (``GoodputError``), not replaced."""
        ...


def _host_path(dest: str, host: str) -> str:
    check_host(host, "broadcast")  # a valid name has no separator and is never "." or ".."
    return dest.replace("{host}", host)


# What may be a destination, and reach a remote command line as a path: absolute, and characters
# no shell, rsync version or ssh config parser treats specially (quoting is kept anyway, as a
# second guard).
SAFE_PATH = re.compile(r"/[A-Za-z0-9_.+,=@%/-]*")


def _check_path(path: str, where: str, given: str) -> None:
    """Refuse ``path``, ``given`` as such by the user, unless SAFE_PATH matches the whole of it."""
    # normpath: no "..", "." or "//" parts, and "/" itself is refused since the copy replaces it.
    if not SAFE_PATH.fullmatch(path) or os.path.normpath(path) != path or path == "/":
        raise GoodputError.usage(
            where,
            f"{given!r} is not a safe absolute path",
            "use a normalized absolute path of letters, digits and _.+,=@%-, e.g. /tmp/venv",
        )


def _check_dest(dest: str) -> None:
    # Any valid host name keeps a safe path safe, so one stands for all.
    _check_path(_host_path(dest, "h"), "--dest", dest)


def not_goodputs_copy(path: str) -> GoodputError:
    return GoodputError(
        path,
        f"exists and is not a copy goodput made (it has no {MARKER}), so it is not replaced",
        "move it away or choose another --dest",
    )


def _check_replaceable(final: Path) -> None:
    """Refuse ``final`` if it exists and is not a folder holding our marker (links included)."""
    if not os.path.lexists(final):
        return
    marker = final / MARKER
    if final.is_symlink() or not final.is_dir() or marker.is_symlink() or not marker.is_file():
        raise not_goodputs_copy(str(final))


class LocalTransport:
    """Every "host" is a folder on this machine: ``dest`` with ``{host}`` replaced."""

    rewrites_venv_prefix = True

    def __init__(self, dest: str, ssh_config: Path | None = None) -> None:
        if ssh_config is not None:
            raise GoodputError.usage(
                "--ssh-config",
                "the local transport runs no ssh",
                "drop --ssh-config, or use --transport rsync or tar",
            )
        if "{host}" not in dest:
            raise GoodputError.usage(
                "--dest",
                f"{dest!r} has no {{host}} for the local transport",
                "give each host its own folder, e.g. /tmp/nodes/{host}/venv",
            )
        _check_dest(dest)
        self.dest = dest

    def path(self, host: str) -> str:
        return _host_path(self.dest, host)

    def copy(self, origin: Path, src_host: str | None, dst_host: str, marker: str) -> None:
        src = origin.absolute() if src_host is None else Path(self.path(src_host))
        dst = Path(self.path(dst_host))
        _check_replaceable(dst)  # before the copy, so a refusal costs nothing
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
        try:
            shutil.copytree(src, tmp, symlinks=True, dirs_exist_ok=True, ignore=special_entries)
            os.chmod(tmp, DIR_MODE)
            fix_venv_prefix(tmp, old=str(src), new=str(dst))
            # A copy of a copy brings its source's marker, maybe a link: replaced, not followed.
            write_inside(tmp, MARKER, f"{marker}\n".encode())
            _check_replaceable(dst)  # and again: something may have appeared meanwhile
            if os.path.lexists(dst):
                shutil.rmtree(dst)
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# Run on a destination host before a copy and before it is published, by sh whatever the login
# shell is: exit 3 with REFUSED when the final path ($1) exists and is not a copy goodput made
# (a link, or no MARKER file in it), and drop a partial copy ($2) that is a link: it would
# steer rsync --delete into another folder. No "!": csh-family login shells expand it.
GUARD = f"""\
refuse() {{ echo "{REFUSED} $1" >&2; exit 3; }}
if [ -L "$1" ] || [ -L "$1/{MARKER}" ]; then refuse "$1"; fi
if [ -e "$1" ]; then [ -f "$1/{MARKER}" ] || refuse "$1"; fi
if [ -L "$2" ]; then rm -f -- "$2"; fi"""


class RemoteTransport:
    """Copies between hosts over ssh; ``commands`` is the argv pipelines of one copy, in order."""

    rewrites_venv_prefix = False

    def __init__(self, dest: str, ssh_config: Path | None = None) -> None:
        _check_dest(dest)
        self.dest = dest
        self.ssh = ["ssh"]
        if ssh_config is not None:
            # Absolute: the source hosts run ssh with it too, from their home folders.
            config = ssh_config.absolute()
            _check_path(str(config), "--ssh-config", str(ssh_config))
            if not config.is_file():
                raise GoodputError.usage(
                    "--ssh-config",
                    f"{ssh_config} is not a file",
                    "give an ssh client config file",
                )
            self.ssh += ["-F", str(config)]

    def path(self, host: str) -> str:
        return _host_path(self.dest, host)

    def commands(
        self, origin: Path, src_host: str | None, dst_host: str, marker: str
    ) -> list[list[list[str]]]:
        raise NotImplementedError

    def copy(self, origin: Path, src_host: str | None, dst_host: str, marker: str) -> None:
        final = f"{dst_host}:{self.path(dst_host)}"
        for pipeline in self.commands(origin, src_host, dst_host, marker):
            _run_pipeline(pipeline, refused=not_goodputs_copy(final))

    def on(self, host: str, *argv: str) -> list[str]:
        """Run ``argv`` on ``host``: ssh joins its arguments into one line, so quote each."""
        return [*self.ssh, host, shlex.join(argv)]

    def guarded(self, dst_host: str, then: str, *args: str, shell: str = "sh") -> list[str]:
        """``sh -c GUARD; then`` for ``dst_host``'s final path ($1) and partial copy ($2);
        ``shell="bash"`` runs it with pipefail, for a pipeline whose every part must succeed."""
        final = self.path(dst_host)
        argv = ["sh", "-c"] if shell == "sh" else ["bash", "-o", "pipefail", "-c"]
        return [*argv, f"{GUARD}\n{then}", "sh", final, f"{final}.partial", *args]

    def _publish(self, dst_host: str, marker: str) -> list[list[str]]:
        """Mark the finished temp copy and rename it onto the final path, on ``dst_host``."""
        # rm first: a link copied in as the marker must not steer the write elsewhere.
        marked = f'rm -f -- "$2/{MARKER}" && printf "%s\\n" "$3" >"$2/{MARKER}"'
        publish = f'{marked} && rm -rf -- "$1" && mv -- "$2" "$1"'
        return [self.on(dst_host, *self.guarded(dst_host, publish, marker))]


class RsyncTransport(RemoteTransport):
    def commands(
        self, origin: Path, src_host: str | None, dst_host: str, marker: str
    ) -> list[list[list[str]]]:
        partial = self.path(dst_host) + ".partial"
        # rsync makes the last folder only; --rsync-path runs before the receiver on dst_host.
        prepare = shlex.join(self.guarded(dst_host, 'mkdir -p -- "$2"'))
        rsync = ["rsync", "-a", "--delete", "-e", shlex.join(self.ssh)]
        rsync += ["--rsync-path", f"{prepare} && rsync"]
        target = f"{dst_host}:{partial}/"
        if src_host is None:
            push = [*rsync, f"{origin.absolute()}/", target]
        else:  # the source host pushes, so the bytes never pass through this machine
            push = self.on(src_host, *rsync, f"{self.path(src_host)}/", target)
        return [[push], self._publish(dst_host, marker)]


class TarTransport(RemoteTransport):
    def commands(
        self, origin: Path, src_host: str | None, dst_host: str, marker: str
    ) -> list[list[list[str]]]:
        # A stale partial from a failed try would mix with this one: start empty.
        unpack = 'rm -rf -- "$2" && mkdir -p -- "$2" && tar -C "$2" -xf -'
        receive = self.on(dst_host, *self.guarded(dst_host, unpack))
        if src_host is None:
            stream = [["tar", "-C", str(origin.absolute()), "-cf", "-", "."], receive]
        else:
            # pipefail: tar -c skips a file it cannot read and only its exit status says so; the
            # copy must fail, not be published without it. bash: the user's shell may be any.
            pack = shlex.join(["tar", "-C", self.path(src_host), "-cf", "-", "."])
            line = f"{pack} | {shlex.join(receive)}"
            stream = [self.on(src_host, "bash", "-o", "pipefail", "-c", line)]
        return [stream, self._publish(dst_host, marker)]


class ArchiveTransport(RemoteTransport):
    """``--compress``: ``origin`` is one tar + zstd file (``archive.write_archive``), sent as it
    is. A host keeps its copy of the archive beside its final path (``archive_path``) and serves
    the next hosts from that, so no host packs or compresses anything; each unpacks once, while
    the archive arrives. ``remove_archive`` drops a host's archive when the broadcast is over."""

    def archive_path(self, host: str) -> str:
        return self.path(host) + ARCHIVE_SUFFIX

    def commands(
        self, origin: Path, src_host: str | None, dst_host: str, marker: str
    ) -> list[list[list[str]]]:
        # $3: this host's archive. A failed unpack leaves neither a partial copy nor an archive.
        unpack = (
            'rm -rf -- "$2" && rm -f -- "$3" && mkdir -p -- "$2" && '
            '{ tee -- "$3" | zstd -dcq | tar -C "$2" -xf - ; } '
            '|| { status=$?; rm -rf -- "$2" "$3"; exit "$status"; }'
        )
        archive = self.archive_path(dst_host)
        receive = self.on(dst_host, *self.guarded(dst_host, unpack, archive, shell="bash"))
        if src_host is None:
            stream = [["cat", "--", str(origin.absolute())], receive]
        else:
            send = shlex.join(["cat", "--", self.archive_path(src_host)])
            line = f"{send} | {shlex.join(receive)}"
            stream = [self.on(src_host, "bash", "-o", "pipefail", "-c", line)]
        return [stream, self._publish(dst_host, marker)]

    def remove_archive(self, host: str) -> None:
        remove = self.on(host, "rm", "-f", "--", self.archive_path(host))
        _run_pipeline([remove], refused=not_goodputs_copy(self.archive_path(host)))


TRANSPORTS: dict[str, Callable[[str, Path | None], Transport]] = {
    "local": LocalTransport,
    "rsync": RsyncTransport,
    "tar": TarTransport,
}


def make_transport(
    kind: str, dest: str, ssh_config: Path | None = None, *, compress: bool = False
) -> Transport:
    """The transport of ``kind``; ``compress``: the tar one's archive form."""
    if compress and kind != "tar":
        raise GoodputError.usage(
            "--compress",
            f"sends one tar.zst archive host to host, which the {kind} transport does not",
            "use --transport tar (the default with --compress)",
        )
    if compress:
        return ArchiveTransport(dest, ssh_config)
    if kind not in TRANSPORTS:
        raise GoodputError.usage(
            "--transport",
            f"unknown transport {kind!r}",
            f"use one of {', '.join(TRANSPORTS)}",
        )
    return TRANSPORTS[kind](dest, ssh_config)


def _run_pipeline(argvs: Sequence[list[str]], refused: GoodputError) -> None:
    """Run argv lists connected stdout to stdin; raise with every failed command's stderr, or
    ``refused`` when a command's ``GUARD`` refused the destination.

    Every command is waited for: when one end of a pipe fails the other usually fails too (a broken
    pipe), and only both messages together say which was the cause. Stderr goes to files, not
    pipes, so a chatty command cannot block while another one is waited for.
    """
    failures = []
    with contextlib.ExitStack() as stack:
        commands = []
        reader: IO[bytes] | None = None  # the previous command's stdout
        for i, argv in enumerate(argvs):
            err = stack.enter_context(tempfile.TemporaryFile())
            proc = subprocess.Popen(
                argv,
                # DEVNULL, not our stdin: ssh would read it (a terminal, a test runner's).
                stdin=subprocess.DEVNULL if reader is None else reader,
                stdout=subprocess.PIPE if i < len(argvs) - 1 else subprocess.DEVNULL,
                stderr=err,
            )
            stack.callback(_kill, proc)  # on any way out; a no-op for a command that ended
            if reader is not None:
                reader.close()  # the reader's copy only, so a writer sees it die (SIGPIPE)
            reader = proc.stdout
            if reader is not None:
                stack.callback(reader.close)
            commands.append((argv, proc, err))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        for argv, proc, err in commands:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                err.seek(0)
                said = err.read(1 << 16).decode(errors="replace")
                if REFUSED in said:
                    raise refused
                # The head: the cause comes first (ssh's, before rsync's "connection closed").
                message = " ".join(said.split())[:200]
                failures.append(
                    f"{argv[0]} exited {proc.returncode}" + (f": {message}" if message else "")
                )
    if failures:
        raise RuntimeError("; ".join(failures))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def is_venv(folder: Path) -> bool:
    return (folder / "pyvenv.cfg").is_file() and (folder / "bin" / "activate").is_file()


def prefix_pattern(old: str) -> re.Pattern[bytes]:
    """``old``, a venv's path, as a whole path only: /a/venv must not match inside /a/venv2."""
    return re.compile(re.escape(old.encode()) + rb"(?![A-Za-z0-9._-])")


def _names_prefix_throughout(relative_path: str) -> bool:
    """``pyvenv.cfg`` and ``bin/activate*``: venv files that may name the venv anywhere."""
    return relative_path == "pyvenv.cfg" or (
        may_change(relative_path) and relative_path.rpartition("/")[2].startswith("activate")
    )


def _prefix_end(relative_path: str, data: bytes) -> int:
    """How many of a venv file's first bytes may name the venv's path: all of those named
    throughout, the first line (the shebang) of another ``bin/*`` script, none of any other
    file."""
    if _names_prefix_throughout(relative_path):
        return len(data)
    if may_change(relative_path) and data.startswith(b"#!"):
        newline = data.find(b"\n")
        return len(data) if newline < 0 else newline
    return 0


def venv_file_fixer(old: str, new: str) -> Callable[[str, bytes], bytes]:
    """``fix(relative_path, data)``: a venv file's bytes pointed from ``old`` to ``new``:
    ``pyvenv.cfg`` and ``bin/activate*`` throughout, the shebang line of another ``bin/*``
    script; any other file as it is. ``may_change`` says which paths to read for it."""
    pattern = prefix_pattern(old)
    new_b = new.encode()

    def fix(relative_path: str, data: bytes) -> bytes:
        end = _prefix_end(relative_path, data)
        return pattern.sub(new_b, data[:end]) + data[end:] if end else data

    return fix


def may_change(relative_path: str) -> bool:
    """Whether ``venv_file_fixer`` may rewrite the venv file at ``relative_path``."""
    parts = relative_path.split("/")
    return relative_path == "pyvenv.cfg" or (len(parts) == 2 and parts[0] == "bin")


# What is read of a script reached through a link to see whether its shebang names the venv.
SHEBANG_HEAD_BYTES = 64 << 10


def check_venv_links(venv: Path, old: str) -> None:
    """Refuse, naming the link, a venv at ``old`` where a file that a copy's prefix rewrite
    changes (``venv_file_fixer``: one that names ``old``) is a link or lies under one (``bin/``
    a link to a folder elsewhere): rewriting it would write through the link, outside the copy
    and into someone's files, and leaving it would leave the copy naming the source. Other links
    (``bin/python`` to its interpreter, a link to data) are copied as links and never written
    through. Reads the source only; ``fix_venv_prefix`` never follows a link in the copy."""
    pattern = prefix_pattern(old)
    bin_dir = venv / "bin"
    names = ["pyvenv.cfg", *(f"bin/{path.name}" for path in sorted(bin_dir.iterdir()))]
    for name in names:
        link = first_link(venv, name)
        if link is None or not (venv / name).is_file():
            continue  # a file of the venv's own is rewritten in each copy; no file, no rewrite
        with open_regular(venv / name) as file:
            whole = _names_prefix_throughout(name)
            data = file.read(SMALL_FILE_BYTES if whole else SHEBANG_HEAD_BYTES)
        if pattern.search(data, 0, _prefix_end(name, data)):
            raise link_in_the_way(link, f"each copy's own path, in {name},")


def fix_venv_prefix(folder: Path, *, old: str, new: str) -> int:
    """Point a copied venv at its new home (``venv_file_fixer``, over its files in place).

    Only the copy's own files are read and rewritten (``io.read_inside``, ``io.write_inside``):
    a link (``bin/python`` to its interpreter, a ``bin`` that is one) is left as it is, never
    written through. Returns the number of files rewritten; a folder that is not a venv is left
    alone.
    """
    if old == new or not is_venv(folder):
        return 0
    fix = venv_file_fixer(old, new)
    names = ["pyvenv.cfg"]
    if first_link(folder, "bin") is None:
        names += [f"bin/{name}" for name in sorted(os.listdir(folder / "bin"))]
    num_rewritten = 0
    for name in names:
        found = read_inside(folder, name)
        if found is None:
            continue
        data, mode = found
        fixed = fix(name, data)
        if fixed != data:
            write_inside(folder, name, fixed, mode)
            num_rewritten += 1
    return num_rewritten
