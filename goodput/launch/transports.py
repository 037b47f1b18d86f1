"""How one copy of a folder reaches one host's node-local path, for ``broadcast``.

Transports (``TRANSPORTS``, keyed by the CLI ``--transport`` kind) carry out one copy:
  - local: host H's node-local path is ``dest`` with ``{host}`` replaced, on this machine (tests,
    and a demonstration of the tree without a cluster);
  - rsync: ``rsync -a --delete`` over ssh, pushed by the source host;
  - tar: ``tar -c | ssh DST tar -x``, run on the source host.
The remote transports pass ``-F SSH_CONFIG`` to every ssh they start, the ssh a source host runs
to reach the next host included, so that file must sit at the same path on every host.
Invariants: a copy lands under a temp sibling and is renamed onto its final path only when
complete; host names and paths are validated before they reach a command line; local commands
are argv lists and every remote argument is ``shlex.quote``d (ssh hands the remote shell one
string). ``fix_venv_prefix`` points a copied virtual environment at its new path. Standard
library only.
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
from goodput.io import DIR_MODE
from goodput.launch.env import check_host

COMMAND_TIMEOUT_S = 3600.0


class Transport(Protocol):
    # True when ``copy`` points a copied venv at its new path itself; else ``broadcast`` stages.
    rewrites_venv_prefix: bool

    def path(self, host: str) -> str:
        """The node-local path of the copy on ``host``."""
        ...

    def copy(self, origin: Path, src_host: str | None, dst_host: str) -> None:
        """Copy ``origin`` (``src_host`` None) or ``src_host``'s copy to ``dst_host``."""
        ...


def _host_path(dest: str, host: str) -> str:
    return dest.replace("{host}", host)


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
        self.dest = dest

    def path(self, host: str) -> str:
        return os.path.abspath(_host_path(self.dest, host))

    def copy(self, origin: Path, src_host: str | None, dst_host: str) -> None:
        src = origin.absolute() if src_host is None else Path(self.path(src_host))
        dst = Path(self.path(dst_host))
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
        try:
            shutil.copytree(src, tmp, symlinks=True, dirs_exist_ok=True)
            os.chmod(tmp, DIR_MODE)
            fix_venv_prefix(tmp, old=str(src), new=str(dst))
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# What may reach a remote command line as a path: absolute, and characters no shell, rsync
# version or ssh config parser treats specially (quoting is kept anyway, as a second guard).
SAFE_PATH = re.compile(r"^/[A-Za-z0-9_.+,=@%/-]*$")


def _check_path(path: str, where: str, given: str) -> None:
    """Refuse ``path``, ``given`` as such by the user, unless SAFE_PATH matches it."""
    # normpath: no "..", "." or "//" parts, and "/" itself is refused since the copy replaces it.
    if not SAFE_PATH.match(path) or os.path.normpath(path) != path or path == "/":
        raise GoodputError.usage(
            where,
            f"{given!r} is not a safe absolute path",
            "use a normalized absolute path of letters, digits and _.+,=@%-, e.g. /tmp/venv",
        )


class RemoteTransport:
    """Copies between hosts over ssh; ``commands`` is the argv pipelines of one copy, in order."""

    rewrites_venv_prefix = False

    def __init__(self, dest: str, ssh_config: Path | None = None) -> None:
        self.dest = dest
        _check_path(self.path("h"), "--dest", dest)  # valid host names keep a safe path safe
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

    def commands(self, origin: Path, src_host: str | None, dst_host: str) -> list[list[list[str]]]:
        raise NotImplementedError

    def copy(self, origin: Path, src_host: str | None, dst_host: str) -> None:
        for host in (src_host, dst_host):
            if host is not None:
                check_host(host, "broadcast")
        for pipeline in self.commands(origin, src_host, dst_host):
            _run_pipeline(pipeline)

    def on(self, host: str, *argv: str) -> list[str]:
        """Run ``argv`` on ``host``: ssh joins its arguments into one line, so quote each."""
        return [*self.ssh, host, shlex.join(argv)]

    def _publish(self, dst_host: str) -> list[list[str]]:
        """Rename the finished temp copy onto the final path, on ``dst_host``."""
        final = shlex.quote(self.path(dst_host))
        partial = shlex.quote(self.path(dst_host) + ".partial")
        return [[*self.ssh, dst_host, f"rm -rf {final} && mv {partial} {final}"]]


class RsyncTransport(RemoteTransport):
    def commands(self, origin: Path, src_host: str | None, dst_host: str) -> list[list[list[str]]]:
        partial = self.path(dst_host) + ".partial"
        # rsync makes the last folder only; --rsync-path runs before the receiver on dst_host.
        rsync = ["rsync", "-a", "--delete", "-e", shlex.join(self.ssh)]
        rsync += ["--rsync-path", f"mkdir -p {shlex.quote(partial)} && rsync"]
        target = f"{dst_host}:{partial}/"
        if src_host is None:
            push = [*rsync, f"{origin.absolute()}/", target]
        else:  # the source host pushes, so the bytes never pass through this machine
            push = self.on(src_host, *rsync, f"{self.path(src_host)}/", target)
        return [[push], self._publish(dst_host)]


class TarTransport(RemoteTransport):
    def commands(self, origin: Path, src_host: str | None, dst_host: str) -> list[list[list[str]]]:
        partial = shlex.quote(self.path(dst_host) + ".partial")
        # A stale partial from a failed try would mix with this one: start empty.
        unpack = f"rm -rf {partial} && mkdir -p {partial} && tar -C {partial} -xf -"
        receive = [*self.ssh, dst_host, unpack]
        if src_host is None:
            stream = [["tar", "-C", str(origin.absolute()), "-cf", "-", "."], receive]
        else:
            # pipefail: tar -c skips a file it cannot read and only its exit status says so; the
            # copy must fail, not be published without it. bash: the user's shell may be any.
            pack = shlex.join(["tar", "-C", self.path(src_host), "-cf", "-", "."])
            line = f"{pack} | {shlex.join(receive)}"
            stream = [self.on(src_host, "bash", "-o", "pipefail", "-c", line)]
        return [stream, self._publish(dst_host)]


TRANSPORTS: dict[str, Callable[[str, Path | None], Transport]] = {
    "local": LocalTransport,
    "rsync": RsyncTransport,
    "tar": TarTransport,
}


def make_transport(kind: str, dest: str, ssh_config: Path | None = None) -> Transport:
    if kind not in TRANSPORTS:
        raise GoodputError.usage(
            "--transport",
            f"unknown transport {kind!r}",
            f"use one of {', '.join(TRANSPORTS)}",
        )
    return TRANSPORTS[kind](dest, ssh_config)


def _run_pipeline(argvs: Sequence[list[str]]) -> None:
    """Run argv lists connected stdout to stdin; raise with every failed stage's stderr.

    Every stage is waited for: when one end of a pipe fails the other usually fails too (a broken
    pipe), and only both messages together say which was the cause. Stderr goes to files, not
    pipes, so a chatty stage cannot block while another one is waited for.
    """
    failures = []
    with contextlib.ExitStack() as stack:
        stages = []
        reader: IO[bytes] | None = None  # the previous stage's stdout
        for i, argv in enumerate(argvs):
            err = stack.enter_context(tempfile.TemporaryFile())
            proc = subprocess.Popen(
                argv,
                # DEVNULL, not our stdin: ssh would read it (a terminal, a test runner's).
                stdin=subprocess.DEVNULL if reader is None else reader,
                stdout=subprocess.PIPE if i < len(argvs) - 1 else subprocess.DEVNULL,
                stderr=err,
            )
            stack.callback(_kill, proc)  # on any way out; a no-op for a stage that ended
            if reader is not None:
                reader.close()  # the reader's copy only, so a writer sees it die (SIGPIPE)
            reader = proc.stdout
            if reader is not None:
                stack.callback(reader.close)
            stages.append((argv, proc, err))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        for argv, proc, err in stages:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                err.seek(0)
                # The head: the cause comes first (ssh's, before rsync's "connection closed").
                message = " ".join(err.read().decode(errors="replace").split())[:200]
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


def fix_venv_prefix(folder: Path, *, old: str, new: str) -> int:
    """Point a copied venv at its new home: ``bin/activate*``, ``pyvenv.cfg`` (its ``command``
    line) and the shebangs of ``bin/*``.

    Returns the number of files rewritten; a folder that is not a venv is left alone.
    """
    if old == new or not is_venv(folder):
        return 0
    old_b, new_b = old.encode(), new.encode()
    # A whole path only: /a/venv must not match inside /a/venv2.
    pattern = re.compile(re.escape(old_b) + rb"(?![A-Za-z0-9._-])")
    num_rewritten = 0
    for path in [folder / "pyvenv.cfg", *sorted((folder / "bin").iterdir())]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if path.name.startswith("activate") or path.name == "pyvenv.cfg":
            fixed = pattern.sub(new_b, data)
        elif data.startswith(b"#!"):
            first, sep, rest = data.partition(b"\n")
            fixed = pattern.sub(new_b, first) + sep + rest
        else:
            continue
        if fixed != data:
            mode = path.stat().st_mode
            path.write_bytes(fixed)
            os.chmod(path, mode)
            num_rewritten += 1
    return num_rewritten
