"""Exception tree of clusterctl.

    ClusterctlError                 base; carries a one-line message and an exit code
     ├── ConfigError                bad inventory / catalog / router config (exit 2)
     ├── StateError                 state store problems (exit 2)
     ├── ProbeError                 a node could not be probed (reported per node)
     │    └── SSHError              connect/auth/host-key/timeout/disconnect
     └── Unschedulable              placement found no home for a replica (exit 3)

Every message is meant to be printed on one line as-is: it names the file, field or
node it is about.
"""

from __future__ import annotations


class ExitCode:
    OK = 0
    PARTIAL = 1  # some nodes did not answer
    CONFIG = 2  # bad input
    UNPLACED = 3  # some replica could not be placed


class ClusterctlError(Exception):
    exit_code: int = ExitCode.CONFIG

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(ClusterctlError):
    exit_code = ExitCode.CONFIG


class StateError(ClusterctlError):
    exit_code = ExitCode.CONFIG


class ProbeError(ClusterctlError):
    exit_code = ExitCode.PARTIAL


class SSHError(ProbeError):
    pass


class Unschedulable(ClusterctlError):
    exit_code = ExitCode.UNPLACED
