"""The README's commands are what CI runs, and the package layout holds."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_command(marker):
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)\n```", text, re.S)
    assert m, f"README has no {marker} block"
    return m.group(1).strip()


def test_ci_runs_readme_install_and_test_commands():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    for marker in ("install-command", "test-command"):
        cmd = _readme_command(marker)
        assert cmd in ci, f"{marker} {cmd!r} not run by .ci/run"
    assert "-eq 5" in ci  # "no tests" must fail


def test_kernels_do_not_include_torch():
    # Pure CUDA kernels stay free of torch headers (fast to compile, testable
    # alone); only csrc/binding may include them.
    for fam in os.listdir(os.path.join(ROOT, "csrc")):
        if fam == "binding":
            continue
        d = os.path.join(ROOT, "csrc", fam)
        for f in os.listdir(d):
            src = open(os.path.join(d, f)).read()
            assert not re.search(r"#include\s*[<\"](torch|ATen|c10|pybind11)/", src), f"{fam}/{f} includes torch"



@pytest.mark.parametrize("stale_version", [None, "previous"])
def test_extension_from_other_sources_is_refused(monkeypatch, stale_version):
    """An lpmoe._C built before a binding changed (an older version number,
    or none: built before the handshake) is refused with an error that says
    to rebuild, before any kernel call; the one built from these sources
    (when there is one) has this package's binding version."""
    import sys
    import types

    import lpmoe
    from lpmoe import _ext
    _ext.ext.cache_clear()
    try:
        if _ext.has_extension():
            assert _ext.ext().BINDING_VERSION == _ext.BINDING_VERSION
        _ext.ext.cache_clear()
        stale = types.ModuleType("lpmoe._C")
        if stale_version is not None:
            stale.BINDING_VERSION = _ext.BINDING_VERSION - 1
        monkeypatch.setitem(sys.modules, "lpmoe._C", stale)
        monkeypatch.setattr(lpmoe, "_C", stale, raising=False)
        with pytest.raises(RuntimeError, match=re.escape(f"this package calls version {_ext.BINDING_VERSION}")):
            _ext.ext()
        assert not _ext.has_extension()
    finally:
        _ext.ext.cache_clear()
