"""The type stubs kept in python/linattn are what scripts/stubs.py makes from the package now
(pybind11-stubgen for the compiled module, the registry's signatures for the functions)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
STUBS = ["_linattn.pyi", "__init__.pyi", "torch/__init__.pyi"]


def test_stubs_are_current(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "stubs.py"), str(tmp_path)], check=True)
    for name in STUBS:
        kept = (ROOT / "python" / "linattn" / name).read_text()
        made = (tmp_path / "linattn" / name).read_text()
        assert kept == made, "python/linattn/%s is out of date: run `make stubs`" % name
    assert (ROOT / "python" / "linattn" / "py.typed").exists()
