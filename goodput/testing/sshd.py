"""The loopback OpenSSH server that ``.ci/start-sshd`` runs for tests of the ssh transports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# Written by .ci/start-sshd: aliases node1..node4, all this machine's test sshd.
SSH_CONFIG = Path("/tmp/goodput-sshd/ssh_config")


def sshd_answers() -> bool:
    """Whether the test sshd is up and ssh and rsync are installed."""
    if not SSH_CONFIG.is_file() or not (shutil.which("ssh") and shutil.which("rsync")):
        return False
    probe = ["ssh", "-F", str(SSH_CONFIG), "node1", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False
