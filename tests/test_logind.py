"""``logind.read_logind`` over fake roots: where ``RemoveIPC=`` comes from, who is exempt, what is unreadable.

Each tree is written under ``tmp_path``; nothing reads the real /etc. Unreadable files are directories where a
file should be (reading one raises even for root), as in ``test_host_probe``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ms_shm import host, logind
from ms_shm.logind import read_logind

PASSWD = "root:x:0:0:root:/root:/bin/bash\nsyslog:x:104:110::/home/syslog:/usr/sbin/nologin\n" \
         "alice:x:1000:1000:Alice:/home/alice:/bin/bash\n"


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def systemd_host(root: Path, conf: str | None = None) -> Path:
    """A systemd host (``/run/systemd/system``) with alice as its only normal user, nobody lingering."""
    (root / "run/systemd/system").mkdir(parents=True)
    (root / "var/lib/systemd/linger").mkdir(parents=True)
    write(root, "etc/passwd", PASSWD)
    if conf is not None:
        write(root, "etc/systemd/logind.conf", conf)
    return root


def alice(root: Path) -> logind.LogindFacts:
    return read_logind(root, uid=1000)


DEBIAN_CONF = "[Login]\n#NAutoVTs=6\n#KillUserProcesses=no\n#RemoveIPC=yes\n#InhibitDelayMaxSec=5\n"


@pytest.mark.parametrize("conf, value, source", [
    (None, True, "systemd default"),                                        # no file at all: compiled-in yes
    ("[Login]\n", True, "systemd default"),
    (DEBIAN_CONF, True, "systemd default, as /etc/systemd/logind.conf shows it commented out"),
    ("[Login]\n#RemoveIPC=no\n", False, "systemd default, as /etc/systemd/logind.conf shows it commented out"),
    ("[Login]\nRemoveIPC=no\n", False, "/etc/systemd/logind.conf"),
    ("[Login]\nRemoveIPC = off\n", False, "/etc/systemd/logind.conf"),
    ("[Login]\n  RemoveIPC=YES  \n", True, "/etc/systemd/logind.conf"),
    ("[Login]\nRemoveIPC=no\nRemoveIPC=1\n", True, "/etc/systemd/logind.conf"),  # the last assignment wins
    ("[Other]\nRemoveIPC=no\n", True, "systemd default"),                    # outside [Login]: not logind's
    ("RemoveIPC=no\n[Login]\n", True, "systemd default"),                    # before any section
    ("[Login]\n; RemoveIPC=no is a comment too\n", True, "systemd default"),
])
def test_main_file(tmp_path, conf, value, source):
    facts = alice(systemd_host(tmp_path, conf))
    assert (facts.remove_ipc, facts.source) == (value, source)
    assert facts.at_risk is value and facts.user == "alice" and facts.system_user is False


def test_invalid_boolean_is_ignored_with_a_note(tmp_path):
    facts = alice(systemd_host(tmp_path, "[Login]\nRemoveIPC=no\nRemoveIPC=maybe\n"))
    assert facts.remove_ipc is False  # logind ignores the bad line and keeps the earlier one
    assert any("RemoveIPC=maybe is not a boolean" in n for n in facts.notes)


def test_main_file_is_the_first_found(tmp_path):
    root = systemd_host(tmp_path)
    write(root, "usr/lib/systemd/logind.conf", "[Login]\nRemoveIPC=no\n")
    assert alice(root).source == "/usr/lib/systemd/logind.conf" and not alice(root).at_risk
    write(root, "etc/systemd/logind.conf", DEBIAN_CONF)  # /etc's copy replaces the vendor's whole
    assert alice(root).remove_ipc is True


def test_dropins_override_and_sort_by_name(tmp_path):
    root = systemd_host(tmp_path, "[Login]\nRemoveIPC=no\n")
    write(root, "usr/lib/systemd/logind.conf.d/10-vendor.conf", "[Login]\nRemoveIPC=yes\n")
    facts = alice(root)
    assert (facts.remove_ipc, facts.source) == (True, "/usr/lib/systemd/logind.conf.d/10-vendor.conf")
    # sorted by name across directories: /run's 20-* comes after /usr/lib's 10-*
    write(root, "run/systemd/logind.conf.d/20-runtime.conf", "[Login]\nRemoveIPC=no\n")
    assert alice(root).source == "/run/systemd/logind.conf.d/20-runtime.conf"
    write(root, "etc/systemd/logind.conf.d/ms_shm.conf", "[Login]\nRemoveIPC=no\n")
    write(root, "usr/lib/systemd/logind.conf.d/zz-later.conf", "[Login]\nRemoveIPC=yes\n")
    facts = alice(root)
    assert (facts.remove_ipc, facts.source) == (True, "/usr/lib/systemd/logind.conf.d/zz-later.conf")
    write(root, "usr/lib/systemd/logind.conf.d/not-a-dropin.txt", "[Login]\nRemoveIPC=no\n")
    assert alice(root).remove_ipc is True


def test_same_name_in_etc_masks_the_vendor_file(tmp_path):
    root = systemd_host(tmp_path)
    write(root, "usr/lib/systemd/logind.conf.d/50-vendor.conf", "[Login]\nRemoveIPC=no\n")
    assert alice(root).remove_ipc is False
    (root / "etc/systemd/logind.conf.d").mkdir(parents=True)
    os.symlink("/dev/null", root / "etc/systemd/logind.conf.d/50-vendor.conf")  # the documented way to disable it
    facts = alice(root)
    assert (facts.remove_ipc, facts.source, facts.at_risk) == (True, "systemd default", True)


def test_linger(tmp_path):
    root = systemd_host(tmp_path, DEBIAN_CONF)
    write(root, "var/lib/systemd/linger/alice", "")
    facts = alice(root)
    assert facts.linger is True and facts.at_risk is False and "lingering is on for alice" in facts.reason
    assert read_logind(root, user="alice").uid == 1000  # by name as well as by uid


def test_root_and_system_users_are_exempt(tmp_path):
    root = systemd_host(tmp_path, "[Login]\nRemoveIPC=yes\n")
    facts = read_logind(root, uid=0)
    assert (facts.user, facts.system_user, facts.at_risk) == ("root", True, False) and "root" in facts.reason
    syslog = read_logind(root, uid=104)
    assert syslog.system_user is True and not syslog.at_risk and "system user (uid 104 <= 999)" in syslog.reason


@pytest.mark.parametrize("defs, boundary", [
    ("SYS_UID_MAX  1999\n", 1999),
    ("#SYS_UID_MAX  999\nUID_MIN  2000\n", 1999),  # shadow derives it from UID_MIN
    ("# nothing about uids\n", 999),
])
def test_system_user_boundary_from_login_defs(tmp_path, defs, boundary):
    root = systemd_host(tmp_path)
    write(root, "etc/login.defs", defs)
    facts = alice(root)
    assert facts.sys_uid_max == boundary and facts.system_user is (1000 <= boundary)


def test_no_systemd_means_no_risk(tmp_path):
    """A container image may ship logind.conf; without systemd running nothing reads it."""
    root = systemd_host(tmp_path, "[Login]\nRemoveIPC=yes\n")
    (root / "run/systemd/system").rmdir()
    facts = alice(root)
    assert facts.remove_ipc is True and facts.systemd_present is False
    assert not facts.at_risk and not facts.undetermined and "systemd is not running" in facts.reason


def test_unreadable_main_file_is_unknown_until_a_dropin_decides(tmp_path):
    root = systemd_host(tmp_path)
    (root / "etc/systemd/logind.conf").mkdir(parents=True)  # read() raises IsADirectoryError
    facts = alice(root)
    assert facts.remove_ipc is None and not facts.at_risk and facts.undetermined
    assert "RemoveIPC unknown" in facts.reason and any("logind.conf" in n for n in facts.notes)
    write(root, "etc/systemd/logind.conf.d/ms_shm.conf", "[Login]\nRemoveIPC=no\n")
    facts = alice(root)
    assert facts.remove_ipc is False and not facts.undetermined  # a drop-in overrides whatever it said


def test_unreadable_dropin_directory_and_linger_directory(tmp_path):
    root = systemd_host(tmp_path, DEBIAN_CONF)
    write(root, "etc/systemd/logind.conf.d", "not a directory\n")
    (root / "var/lib/systemd/linger").rmdir()
    write(root, "var/lib/systemd/linger", "not a directory either\n")
    facts = alice(root)
    assert facts.remove_ipc is None and facts.linger is None and facts.undetermined and not facts.at_risk
    assert any("logind.conf.d" in n for n in facts.notes) and any("linger" in n for n in facts.notes)


def test_unknown_user_is_undetermined_not_a_guess(tmp_path):
    root = systemd_host(tmp_path, DEBIAN_CONF)
    facts = read_logind(root, uid=4242)
    assert facts.user is None and facts.linger is None and facts.undetermined and not facts.at_risk
    assert any("uid 4242" in n for n in facts.notes)


def test_host_probe_carries_it(tmp_path):
    root = systemd_host(tmp_path, DEBIAN_CONF)
    facts = host.probe(root)
    assert isinstance(facts.logind, logind.LogindFacts) and facts.logind.uid == os.geteuid()
    assert facts.to_dict()["logind"]["source"].startswith("systemd default")


def test_real_host_never_raises():
    facts = read_logind()
    assert isinstance(facts.at_risk, bool) and isinstance(facts.to_json(), str) and facts.reason
