"""scripts/check-deps against this machine's real dpkg database and the real build.

It must pass with the project's package list and fail, naming the package, when a
package the build needs is taken out of the list.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check-deps"
PACKAGES = ROOT / "scripts" / "packages.txt"
BUILD = Path(os.environ.get("ECX_BUILD_DIR", ROOT / "build"))

pytestmark = [
    pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="needs a Debian system (dpkg-query)"),
    pytest.mark.skipif(not (BUILD / ".ninja_deps").exists(), reason=f"needs a Ninja build in {BUILD} (ECX_BUILD_DIR)"),
]


def check(packages: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(BUILD), "--packages", str(packages)],
                          capture_output=True, text=True, timeout=120)


def without(tmp_path: Path, package: str) -> Path:
    lines = PACKAGES.read_text().splitlines()
    kept = [line for line in lines if line.split("#", 1)[0].split()[:1] != [package]]
    assert len(kept) == len(lines) - 1, f"{package} is not in {PACKAGES}"
    out = tmp_path / "packages.txt"
    out.write_text("\n".join(kept) + "\n")
    return out


def test_the_project_list_covers_everything_the_build_uses():
    result = check(PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-deps: ok" in result.stdout


# One of each kind of use, each a package no other listed package pulls in: headers
# the compiler reads (and a library the binaries load), a program a bench runs (through
# Debian's alternatives), a Python module the tests import.
@pytest.mark.parametrize("package", ["libxxhash-dev", "libucx-dev", "valgrind", "gnuplot-nox", "python3-pytest"])
def test_a_package_taken_out_of_the_list_is_named(tmp_path, package):
    result = check(without(tmp_path, package))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"package '{package}' is used" in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith(f"add to scripts/packages.txt: {package}"), result.stderr
