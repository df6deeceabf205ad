"""Shell completion: clusterctl answers the completion protocol of bash and zsh."""

from __future__ import annotations

import os
import subprocess
import sys


def _complete(**env: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "cluster_cli"], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    ).stdout


def test_bash_gets_a_completion_script_and_completes_commands_and_options() -> None:
    assert "complete " in _complete(_CLUSTERCTL_COMPLETE="source_bash")
    assert _complete(_CLUSTERCTL_COMPLETE="complete_bash", COMP_WORDS="clusterctl serve-r", COMP_CWORD="1").split() == [
        "serve-router"
    ]
    got = _complete(_CLUSTERCTL_COMPLETE="complete_bash", COMP_WORDS="clusterctl up --check", COMP_CWORD="2")
    assert "--check-version" in got.split()


def test_zsh_gets_a_completion_script() -> None:
    assert "#compdef clusterctl" in _complete(_CLUSTERCTL_COMPLETE="source_zsh")
