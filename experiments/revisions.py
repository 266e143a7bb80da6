"""A revision of this repository checked out beside the working tree, for experiments that compare two revisions
in one run (their workers import each side's library from its own directory)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def revision_checkout(revision: str):
    """A temporary git worktree of `revision` (its tracked files: code and shipped checkpoints); yields its path."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "--detach", path, revision], cwd=REPO, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO, capture_output=True)
