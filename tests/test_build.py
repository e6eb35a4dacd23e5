"""The extension build's choice of C++ compiler (spinfer/build.py, host_compiler): a compiler that
links the C++ runtime statically makes a failed check crash the process instead of raising, so
the build picks another where torch's default does that. CPU only: the choice is made before
nvcc runs."""

import os
import re
import shutil

import pytest

from spinfer import build


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("readelf") is None, reason="needs c++ and readelf")
def test_probe_reads_how_a_real_compiler_links(tmp_path):
    # CI's c++ links libstdc++ dynamically (the lent GPU machines' does not); forced static
    # through a wrapper, the probe must see the difference.
    assert build.shares_libstdcxx("c++") in (True, False)
    wrapper = tmp_path / "static-c++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("c++")} "$@" -static-libstdc++ -static-libgcc\n')
    wrapper.chmod(0o755)
    assert build.shares_libstdcxx(str(wrapper)) is False


def test_probe_cannot_tell_without_the_compiler():
    assert build.shares_libstdcxx("spinfer-no-such-compiler") is None


def test_versioned_compilers_sort_by_number():
    assert build.newest_first(["/u/g++-9", "/u/g++-13", "/u/g++-12"]) == ["/u/g++-13", "/u/g++-12", "/u/g++-9"]
    assert build.system_gxx()[-1] == "/usr/bin/g++"


def fake(monkeypatch, links, cxx=None):
    """shares_libstdcxx answered from `links` (compiler -> True / False / None), the system's g++
    the keys under /nx (a folder that does not exist, so none resolves to a real compiler), and
    CXX set to `cxx`."""
    if cxx is None:
        monkeypatch.delenv("CXX", raising=False)
    else:
        monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(build, "shares_libstdcxx", lambda c: links.get(c))
    monkeypatch.setattr(build, "system_gxx", lambda: [k for k in links if k.startswith("/nx/")])


def test_torchs_compiler_stays_where_it_links_dynamically_or_cannot_be_told(monkeypatch):
    fake(monkeypatch, {"c++": True, "/nx/g++-13": True})
    assert build.host_compiler() is None
    fake(monkeypatch, {"c++": None, "/nx/g++-13": True})
    assert build.host_compiler() is None
    fake(monkeypatch, {"/opt/my/g++": True, "c++": True}, cxx="/opt/my/g++")
    assert build.host_compiler() is None  # the user's CXX, dynamic


def test_a_static_default_gives_way_to_the_first_dynamic_gxx(monkeypatch):
    fake(monkeypatch, {"c++": False, "/nx/g++-13": False, "/nx/g++-12": True, "/nx/g++": True})
    assert build.host_compiler() == "/nx/g++-12"
    fake(monkeypatch, {"c++": False, "/nx/g++-13": None, "/nx/g++": True})
    assert build.host_compiler() == "/nx/g++"


def test_a_static_cxx_gives_way_with_a_warning(monkeypatch):
    # The lent H100 machines: CXX a static wrapper, c++ dynamic.
    fake(monkeypatch, {"/opt/gcc/bin/g++": False, "c++": True, "/nx/g++-13": True}, cxx="/opt/gcc/bin/g++")
    with pytest.warns(RuntimeWarning, match=re.escape("CXX=/opt/gcc/bin/g++ links the C++ runtime statically")):
        assert build.host_compiler() == (shutil.which("c++") or "c++")
    fake(monkeypatch, {"/opt/gcc/bin/g++": False, "c++": False, "/nx/g++-13": True}, cxx="/opt/gcc/bin/g++")
    with pytest.warns(RuntimeWarning, match=re.escape("building with /nx/g++-13 instead")):
        assert build.host_compiler() == "/nx/g++-13"


def test_no_dynamic_compiler_warns(monkeypatch):
    fake(monkeypatch, {"c++": False, "/nx/g++-13": False})
    with pytest.warns(RuntimeWarning, match="set CXX"):
        assert build.host_compiler() is None


def test_the_choice_is_recorded_once_per_build_folder_and_compiler(tmp_path, monkeypatch):
    calls = []
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build, "host_compiler", lambda: calls.append(1) or "/usr/bin/g++-12")
    assert build._chosen_compiler(tmp_path) == "/usr/bin/g++-12"
    assert build._chosen_compiler(tmp_path) == "/usr/bin/g++-12" and len(calls) == 1
    (tmp_path / "host_cxx.txt").write_text("c++\n\n")  # recorded: keep torch's
    assert build._chosen_compiler(tmp_path) is None and len(calls) == 1
    monkeypatch.setenv("CXX", "/opt/other/g++")  # another compiler: asked again
    assert build._chosen_compiler(tmp_path) == "/usr/bin/g++-12" and len(calls) == 2
    (tmp_path / "host_cxx.txt").write_text("garbage")
    assert build._chosen_compiler(tmp_path) == "/usr/bin/g++-12" and len(calls) == 3


def test_env_sets_and_restores(monkeypatch):
    monkeypatch.setenv("SPINFER_TEST_KEY", "a")
    with build._env("SPINFER_TEST_KEY", "b"):
        assert os.environ["SPINFER_TEST_KEY"] == "b"
    assert os.environ["SPINFER_TEST_KEY"] == "a"
    monkeypatch.delenv("SPINFER_TEST_KEY")
    with build._env("SPINFER_TEST_KEY", "b"):
        assert os.environ["SPINFER_TEST_KEY"] == "b"
    assert "SPINFER_TEST_KEY" not in os.environ
    with build._env("SPINFER_TEST_KEY", None):
        assert "SPINFER_TEST_KEY" not in os.environ
