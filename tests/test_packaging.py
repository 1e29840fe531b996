"""The README's commands are what CI runs, and the package layout holds."""
import os
import re

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
