"""PyInstaller runtime hook: give the processes clusterctl starts the environment it was given.

On Linux the bootloader puts the bundle's folder first in ``LD_LIBRARY_PATH`` (and keeps the
value it was given, if any, in ``LD_LIBRARY_PATH_ORIG``). The dynamic loader has read it by the
time this runs (the bundle's own libraries keep loading from the bundle), but every process
clusterctl starts would inherit it: an ssh_config ``Match exec`` or ``ProxyCommand`` would run
the host's ssh, shell or python against the bundle's libssl, libz or libpython. Put back what
the caller had, as PyInstaller's documentation recommends. The bootloader's own variables
(``_PYI_ARCHIVE_FILE``, ``_PYI_PARENT_PROCESS_LEVEL``...: it restarts itself once with them
set) go too: a PyInstaller-built program started by clusterctl would take them for its own.
clusterctl starts no copy of itself (no multiprocessing), which is what they are kept for.
"""

import os
import sys


def _restore() -> None:
    if not getattr(sys, "frozen", False):
        return
    bundle = os.path.realpath(getattr(sys, "_MEIPASS", os.path.dirname(sys.executable)))
    for var in ("LD_LIBRARY_PATH", "LIBPATH", "DYLD_LIBRARY_PATH"):
        orig = os.environ.pop(var + "_ORIG", None)
        if orig is not None:
            os.environ[var] = orig
            continue
        value = os.environ.get(var)
        if value is None:
            continue
        # No _ORIG: the caller had none. Drop the bundle's entries (only those: a value set
        # by someone else is left alone).
        rest = [p for p in value.split(os.pathsep) if p and os.path.realpath(p) != bundle]
        if rest:
            os.environ[var] = os.pathsep.join(rest)
        else:
            del os.environ[var]

    for var in [v for v in os.environ if v.startswith("_PYI_") or v == "_MEIPASS2"]:
        del os.environ[var]


_restore()
