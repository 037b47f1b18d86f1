"""``goodput broadcast``: copy a folder, or a run's newest checkpoint, to a node-local path on
every host by a greedy tree (``goodput.launch.broadcast``, ``goodput.launch.checkpoint_copy``), or
predict how long that takes. Never imports torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode, GoodputError


def register(groups: Subparsers) -> None:
    sub = groups.add_parser(
        "broadcast",
        help="copy a venv or any folder to a node-local path on every host, by a greedy tree",
        description="Copy SOURCE to DEST on every host: each host that has finished becomes a "
        "source, each source serves at most --fanout copies at once, failed copies are retried. "
        "With --checkpoint RUN_DIR, copy the run's newest complete checkpoint to DEST/step-N "
        "instead (older step-N there are removed after), for [checkpoint] local_dir = DEST. "
        "With --compress, SOURCE is read once into one zstd archive that hops host to host. "
        "A venv is staged with the outside folders it imports from (system site-packages, "
        ".pth folders). Links are copied as links and never written through: a venv whose "
        "files each copy rewrites (bin/activate) lie behind a link is refused. "
        "With --simulate, print the predicted makespan of the tree and of a star instead.",
        usage="goodput broadcast SOURCE (--hosts H,...|--hostfile FILE) --dest PATTERN [options]\n"
        "       goodput broadcast SOURCE --compress (--hosts H,...|--hostfile FILE) "
        "--dest PATTERN [options]\n"
        "       goodput broadcast --checkpoint RUN_DIR (--hosts H,...|--hostfile FILE) "
        "--dest PATTERN [options]\n"
        "       goodput broadcast --simulate --nhosts N --copy-seconds T [--fanout K]",
    )
    sub.add_argument("source", nargs="?", type=Path, help="the folder to copy")
    sub.add_argument(
        "--checkpoint",
        type=Path,
        metavar="RUN_DIR",
        help="copy the newest complete checkpoint of this run (or checkpoint folder) to "
        "node-local disk instead",
    )
    sub.add_argument("--hosts", help="comma-separated host names")
    sub.add_argument("--hostfile", type=Path, help="a file of host names, one a line")
    sub.add_argument(
        "--dest",
        help="the node-local path; {host} is replaced by the host name (needed for local)",
    )
    sub.add_argument(
        "--transport",
        help="local, rsync or tar (over ssh; default rsync, or tar with --compress)",
    )
    sub.add_argument(
        "--compress",
        action="store_true",
        help="read SOURCE once into one tar.zst archive in $TMPDIR and send that host to host; "
        "each host unpacks it once (tar over ssh)",
    )
    sub.add_argument(
        "--ssh-config",
        type=Path,
        metavar="FILE",
        help="ssh client config (ssh -F) for rsync and tar, for every hop; same path on all hosts",
    )
    sub.add_argument(
        "--fanout",
        type=argtypes.positive_int,
        default=8,
        help="copies one source serves at once (default 8)",
    )
    sub.add_argument(
        "--retries",
        type=argtypes.non_negative_int,
        default=2,
        help="retries of a failed copy (default 2)",
    )
    sub.add_argument(
        "--min-success",
        type=argtypes.positive_int,
        help="fail unless this many hosts succeed (default: all)",
    )
    sub.add_argument("--simulate", action="store_true", help="predict makespans, copy nothing")
    argtypes.add_renamed(
        sub,
        "--nhosts",
        "--nodes",  # the old spelling, deprecated
        type=argtypes.positive_int,
        help="hosts to simulate",
    )
    sub.add_argument(
        "--copy-seconds",
        type=argtypes.non_negative_float,
        help="seconds one copy takes, to simulate",
    )
    sub.set_defaults(handler=_broadcast)


def _broadcast(args: argparse.Namespace) -> ExitCode:
    """One of three modes, by the options given: --simulate, --checkpoint, else SOURCE."""
    if args.simulate:
        return _simulate(args)
    if args.checkpoint is not None:
        return _copy_checkpoint(args)
    return _copy(args)


def _simulate(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import broadcast

    if args.nhosts is None or args.copy_seconds is None:
        raise GoodputError.usage(
            "broadcast --simulate",
            "needs --nhosts and --copy-seconds",
            "e.g. --simulate --nhosts 10624 --copy-seconds 10",
        )
    tree, star = broadcast.simulate(args.nhosts, args.copy_seconds, args.fanout)
    print(f"tree: {tree:.1f} s ({args.nhosts} hosts, fanout {args.fanout})")
    print(f"star: {star:.1f} s")
    print(f"star/tree: {star / tree:.1f}x" if tree > 0 else "star/tree: n/a")
    return ExitCode.OK


def _copy_checkpoint(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import broadcast, checkpoint_copy, transports

    if args.compress:
        raise GoodputError.usage(
            "broadcast --checkpoint",
            "takes no --compress: a checkpoint's shards are already dense and each host "
            "copies only the newest step",
            "drop --compress",
        )
    if args.source is not None or args.dest is None:
        raise GoodputError.usage(
            "broadcast --checkpoint",
            "takes --dest and no SOURCE",
            "e.g. goodput broadcast --checkpoint RUN_DIR --hostfile $PBS_NODEFILE "
            "--dest /local/scratch/ckpt",
        )
    hosts = broadcast.read_hosts(args.hosts, args.hostfile)
    _check_destinations(args.dest, hosts)
    copied = checkpoint_copy.copy_checkpoint(
        args.checkpoint,
        hosts,
        args.dest,
        lambda dest: transports.make_transport(args.transport or "rsync", dest, args.ssh_config),
        fanout=args.fanout,
        retries=args.retries,
        min_success=args.min_success,
        progress=_progress,
    )
    print(checkpoint_copy.describe(copied, len(hosts)))
    return ExitCode.OK


def _copy(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import broadcast, transports

    if args.source is None or args.dest is None:
        raise GoodputError.usage(
            "broadcast",
            "needs SOURCE and --dest",
            "e.g. goodput broadcast .venv --hostfile $PBS_NODEFILE --dest /tmp/.venv",
        )
    hosts = broadcast.read_hosts(args.hosts, args.hostfile)
    _check_destinations(args.dest, hosts)
    result = broadcast.broadcast(
        args.source,
        hosts,
        transport=transports.make_transport(
            args.transport or ("tar" if args.compress else "rsync"),
            args.dest,
            args.ssh_config,
            compress=args.compress,
        ),
        fanout=args.fanout,
        retries=args.retries,
        min_success=args.min_success,
        progress=_progress,
    )
    by_origin = sum(copy.source == broadcast.ORIGIN for copy in result.copies)
    archive = result.archive
    read_once = (
        f"; source read once: {archive.source_bytes_read:,} bytes, "
        f"archive {archive.archive_bytes:,} bytes"
        if archive is not None
        else ""
    )
    print(
        f"broadcast: {len(result.succeeded)} of {len(hosts)} hosts in {result.makespan_s:.1f} s "
        f"({by_origin} copies from the origin)"
        + read_once
        + (f"; failed: {', '.join(result.failed)}" if result.failed else "")
    )
    return ExitCode.OK  # below --min-success, broadcast() raised


def _check_destinations(dest: str, hosts: list[str]) -> None:
    """Each host's destination, where this machine sees the same path (a shared filesystem, the
    local transport): not in a run directory or a checkpoint. A transport checks the rest
    (absolute, apart from the source, its own marker)."""
    from goodput.outputs import check_outside_runs

    for path in sorted({dest.replace("{host}", host) for host in hosts}):
        if Path(path).is_absolute():
            check_outside_runs(Path(path), "--dest")


def _progress(line: str) -> None:
    print(line, file=sys.stderr)  # stdout keeps only the result
