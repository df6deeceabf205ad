"""Identity files: which keys a login offers, and which of them only ssh-agent can sign with."""

from __future__ import annotations

import functools
import os

from cluster_cli.ssh.libsearch import import_asyncssh

asyncssh = import_asyncssh()

_DEFAULT_KEYS = ("id_ed25519_sk", "id_ecdsa_sk", "id_ed448", "id_ed25519", "id_ecdsa", "id_rsa", "id_dsa")


@functools.lru_cache(maxsize=256)
def key_state(key: str) -> str:
    """``usable`` (a private key), ``locked`` (passphrase-protected: only ssh-agent can sign
    with it), or ``other`` (no private key, or unreadable)."""
    try:
        asyncssh.read_private_key(key)
        return "usable"
    except asyncssh.KeyImportError as e:
        return "locked" if "passphrase" in str(e).lower() else "other"
    except (OSError, ValueError):
        return "other"


def locked(keys: list[str]) -> list[str]:
    """The passphrase-protected ones of ``keys`` (asyncssh skips them: only an agent can sign)."""
    return [k for k in keys if key_state(k) == "locked"]


@functools.lru_cache(maxsize=256)
def agent_identity(key: str) -> str | None:
    """The public key that picks ``key`` out of ssh-agent's keys, when ``key`` is one to be
    used through the agent: a passphrase-protected private key (its ``.pub`` beside it) or a
    public key file. None for a private key usable as it is, or a file that is neither."""
    state = key_state(key)
    if state == "usable":
        return None
    for pub in ([key + ".pub"] if state == "locked" else []) + [key]:
        try:
            asyncssh.read_public_key(pub)
        except (asyncssh.KeyImportError, OSError, ValueError):
            continue
        return pub
    return None


def default_keys() -> list[str]:
    """SSH's default identity files that exist (what asyncssh and OpenSSH try by default)."""
    home = os.path.expanduser(os.path.join("~", ".ssh"))
    return [p for p in (os.path.join(home, n) for n in _DEFAULT_KEYS) if os.path.isfile(p)]


def existing(keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if os.path.isfile(os.path.expanduser(k))]
