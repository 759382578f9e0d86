"""Whether systemd-logind will delete this user's IPC objects under a running job. Facts only, read-only.

``RemoveIPC=yes`` (systemd's compiled-in default, and what Debian and Ubuntu ship commented out) makes logind
delete everything a user owns when the user's last login session ends: SysV message queues and semaphores, SysV
segments nobody has attached, and the user's files in ``/dev/shm`` (systemd's ``clean-ipc.c``). Root and system
users (uid <= ``SYS_UID_MAX``) are skipped, and so is a user with lingering on
(``/var/lib/systemd/linger/<user>``), who never "fully logs out". A MindSpore 2.7+ ``map``/``batch`` worker talks to
the main process through one SysV message queue, so a pipeline running as such a user outside that user's sessions
(a Slurm job, a systemd service or ``systemd-run`` unit, a container with ``--ipc=host``) stops mid-run the moment
the user's last ssh session closes.

Everything is read under ``root`` so tests can point it at a fake tree; nothing here raises: what cannot be read is
``None`` and a note says why.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import field
from pathlib import Path

from ms_shm._results import Result, record

log = logging.getLogger(__name__)

#: Where logind looks, most important first: the main file is the first of these that exists; a drop-in in an
#: earlier directory masks one of the same name in a later one (logind.conf(5)).
CONFIG_DIRS = ("etc/systemd", "run/systemd", "usr/local/lib/systemd", "usr/lib/systemd")
LINGER_DIR = "var/lib/systemd/linger"
DEFAULT_SYS_UID_MAX = 999  # systemd's and shadow's default; the real boundary is fixed when systemd is built
_TRUE = ("1", "yes", "y", "true", "t", "on")  # systemd's parse_boolean(), case-insensitive
_FALSE = ("0", "no", "n", "false", "f", "off")
_COMMENTED = re.compile(r"^\s*[#;]\s*RemoveIPC\s*=\s*(\S+)\s*$", re.MULTILINE)


@record
class LogindFacts(Result):
    """What systemd-logind will do with this user's IPC objects when the user's last session ends.

    Attributes:
        remove_ipc: the effective ``RemoveIPC=``; ``None`` when a file that could set it was unreadable.
        source: the file whose assignment won, or ``"systemd default"`` when none assigns it.
        systemd_present: systemd runs here (``/run/systemd/system`` exists, as ``sd_booted()`` checks). In a
            container it usually does not; the host's logind then only reaches the job through ``--ipc=host``.
        user, uid: whose IPC is judged (the effective uid by default); ``None`` when unknown.
        system_user: ``uid <= sys_uid_max``: logind leaves such users' IPC alone (root always).
        sys_uid_max: the system-user boundary, from ``/etc/login.defs`` (systemd fixes its own when it is built,
            normally from the same file) or 999.
        linger: ``loginctl enable-linger`` is on for ``user``.
        at_risk: all of the above say the IPC is deleted at the user's last logout.
        reason: one line saying why ``at_risk`` is what it is.
        notes: what could not be read, and why.
    """

    remove_ipc: bool | None
    source: str
    systemd_present: bool
    user: str | None
    uid: int | None
    system_user: bool | None
    sys_uid_max: int
    linger: bool | None
    at_risk: bool
    reason: str
    notes: tuple = field(default_factory=tuple)

    @property
    def undetermined(self) -> bool:
        """systemd runs, nothing known rules the removal out, and a fact it depends on could not be read."""
        if not self.systemd_present or self.at_risk:
            return False
        if self.remove_ipc is False or self.system_user or self.linger:
            return False
        return None in (self.remove_ipc, self.system_user, self.linger)


def parse_boolean(text: str) -> bool | None:
    """systemd's booleans (``yes/no/true/false/on/off/1/0``...); ``None`` for anything else, which logind ignores."""
    word = text.strip().lower()
    return True if word in _TRUE else False if word in _FALSE else None


def _assignments(text: str) -> list:
    """Every ``RemoveIPC=`` value under ``[Login]``, in file order (backslash continues a line)."""
    found, section, pending = [], None, ""
    for raw in text.splitlines():
        line = (pending + raw).strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
        elif "=" in line and section == "Login":
            key, _, value = line.partition("=")
            if key.strip() == "RemoveIPC":
                found.append(value.strip())
    return found


def _read(path: Path, notes: list) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        notes.append(f"{path}: {type(exc).__name__}: {exc}")
        return None


def _main_file(root: Path) -> Path | None:
    for d in CONFIG_DIRS:
        path = root / d / "logind.conf"
        if os.path.lexists(path):
            return path
    return None


def _shown(root: Path, path: Path) -> str:
    """``path`` as it is named on the host, whatever ``root`` the tree was read under."""
    try:
        return "/" + str(path.relative_to(root))
    except ValueError:
        return str(path)


def _dropins(root: Path, notes: list) -> list:
    """``logind.conf.d/*.conf`` sorted by file name across all directories, as ``(name, path)``; the same name in a
    more important directory masks the others. An unreadable directory comes last as ``(name, None)``: whatever
    it holds could win."""
    chosen: dict = {}
    unreadable = []
    for d in CONFIG_DIRS:
        folder = root / d / "logind.conf.d"
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        except OSError as exc:
            notes.append(f"{_shown(root, folder)}: {type(exc).__name__}: {exc}")
            unreadable.append((_shown(root, folder), None))
            continue
        for entry in entries:
            if entry.name.endswith(".conf") and entry.name not in chosen and not entry.is_dir():
                chosen[entry.name] = Path(entry.path)
    return sorted(chosen.items()) + unreadable


def _masked(path: Path) -> bool:
    """A drop-in that is a symlink to /dev/null: how an administrator disables a vendor's file."""
    try:
        return path.is_symlink() and os.readlink(path) == "/dev/null"
    except OSError:
        return False


def _winner(root: Path, files: list, notes: list) -> tuple:
    """``(value, source)`` of the last readable ``RemoveIPC=`` in ``files`` (``"unset"`` when none assigns it);
    an unreadable file makes the value ``None`` until a later file assigns it again."""
    value, source = "unset", ""
    for name, path in files:
        text = None if path is None else "" if _masked(path) else _read(path, notes)
        if text is None:
            value, source = None, f"{name} (unreadable)"
            continue
        for raw in _assignments(text):
            parsed = parse_boolean(raw)
            if parsed is None:
                notes.append(f"{_shown(root, path)}: RemoveIPC={raw} is not a boolean; logind ignores it")
            else:
                value, source = parsed, _shown(root, path)
    return value, source


def read_remove_ipc(root: Path, notes: list) -> tuple:
    """``(value, source)``: the assignment that wins (the main file, then drop-ins by name, the last one read
    winning), else the default the main file shows commented out (a vendor file lists the compiled-in
    defaults that way), else systemd's default ``yes``."""
    main = _main_file(root)
    files = ([(_shown(root, main), main)] if main else []) + _dropins(root, notes)
    value, source = _winner(root, files, notes)
    if value != "unset":
        return value, source
    text = _read(main, []) if main and not _masked(main) else None
    hint = _COMMENTED.search(text or "")
    if hint and parse_boolean(hint.group(1)) is not None:
        return parse_boolean(hint.group(1)), f"systemd default, as {_shown(root, main)} shows it commented out"
    return True, "systemd default"


def read_sys_uid_max(root: Path, notes: list) -> int:
    """The last system uid: ``SYS_UID_MAX``, else ``UID_MIN - 1``, from ``/etc/login.defs``; 999 otherwise."""
    path = root / "etc/login.defs"
    if not os.path.lexists(path):
        return DEFAULT_SYS_UID_MAX
    text = _read(path, notes) or ""
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("SYS_UID_MAX", "UID_MIN") and parts[1].isdigit():
            values[parts[0]] = int(parts[1])
    if "SYS_UID_MAX" in values:
        return values["SYS_UID_MAX"]
    return values["UID_MIN"] - 1 if values.get("UID_MIN") else DEFAULT_SYS_UID_MAX


def read_user(root: Path, uid: int | None, user: str | None, notes: list) -> tuple:
    """``(user, uid)`` completed from ``<root>/etc/passwd``, and on the real root from the system's user database
    (NSS: LDAP or SSSD users are not in the file). Lingering is keyed by name, the boundary by uid."""
    if uid is not None and user is not None:
        return user, uid
    passwd = root / "etc/passwd"
    text = _read(passwd, notes) if os.path.lexists(passwd) else ""
    for line in (text or "").splitlines():
        parts = line.split(":")
        if len(parts) > 2 and parts[2].isdigit() and (parts[0] == user if user is not None else
                                                      int(parts[2]) == uid):
            return parts[0], int(parts[2])
    if str(root) == "/" and (user is not None or uid is not None):
        import pwd

        try:
            entry = pwd.getpwnam(user) if user is not None else pwd.getpwuid(uid)
            return entry.pw_name, entry.pw_uid
        except (KeyError, OverflowError):
            pass
    notes.append(f"user of uid {uid}: not found" if user is None else f"uid of user {user}: not found")
    return user, uid


def read_linger(root: Path, user: str | None, notes: list) -> bool | None:
    """Whether ``loginctl enable-linger`` is on: logind only looks for the file ``linger/<user>``."""
    if user is None:
        return None
    path = root / LINGER_DIR / user
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        notes.append(f"{path}: {type(exc).__name__}: {exc}")
        return None


def _verdict(f: dict, notes: list) -> tuple:
    """``(at_risk, reason)`` from the facts read, the safe reasons first."""
    who = f["user"] or f"uid {f['uid']}"
    if not f["systemd_present"]:
        return False, "systemd is not running here (no /run/systemd/system): nothing removes IPC at logout"
    if f["uid"] == 0:
        return False, "root: logind never removes root's IPC"
    if f["system_user"]:
        return False, f"{who} is a system user (uid {f['uid']} <= {f['sys_uid_max']}): logind leaves its IPC alone"
    if f["remove_ipc"] is False:
        return False, f"RemoveIPC=no ({f['source']})"
    if f["linger"]:
        return False, f"lingering is on for {who} (/{LINGER_DIR}/{f['user']}): it never fully logs out"
    unknown = [name for name, key in (("RemoveIPC", "remove_ipc"), ("the uid", "system_user"),
                                      ("lingering", "linger")) if f[key] is None]
    if unknown:
        return False, f"{', '.join(unknown)} unknown" + (f": {notes[0]}" if notes else "")
    return True, (f"RemoveIPC=yes ({f['source']}) and {who} (uid {f['uid']}) is neither a system user nor "
                  "lingering: its message queues, semaphores, unattached SysV segments and /dev/shm files are "
                  "deleted when its last login session ends")


def read_logind(root: Path | str = Path("/"), uid: int | None = None, user: str | None = None) -> LogindFacts:
    """Read logind's ``RemoveIPC=``, the user's lingering and the system-user boundary. Never raises.

    Args:
        root: filesystem root (tests pass a fake tree).
        uid: whose IPC to judge; the effective uid when neither ``uid`` nor ``user`` is given.
        user: the user name, when known (otherwise looked up from ``uid``).

    Returns:
        ``LogindFacts``; ``at_risk`` is true only when every fact says the IPC is removed at logout.
    """
    root = Path(root)
    notes: list = []
    if uid is None and user is None and hasattr(os, "geteuid"):
        uid = os.geteuid()
    user, uid = read_user(root, uid, user, notes)
    value, source = read_remove_ipc(root, notes)
    sys_max = read_sys_uid_max(root, notes)
    f = dict(remove_ipc=value, source=source, systemd_present=(root / "run/systemd/system").is_dir(), user=user,
             uid=uid, system_user=None if uid is None else uid <= sys_max, sys_uid_max=sys_max,
             linger=read_linger(root, user, notes))
    at_risk, reason = _verdict(f, notes)
    for note in notes:
        log.debug("logind: could not determine %s", note)
    return LogindFacts(**f, at_risk=at_risk, reason=reason, notes=tuple(notes))


__all__ = ["LogindFacts", "parse_boolean", "read_logind"]
