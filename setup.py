"""Build hook: setuptools drives the Makefile, the project's one build description.

pyproject.toml holds the metadata; this file only adds the native libraries.
``pip install .`` runs ``make lib BUILD=<build-pip/temp.*/make>`` with this
Python and copies what make built into the wheel, each library into the folder
of the package that loads it:

    pyexpcache/libexpcache_host.so        always (g++)
    pyexpcache/libexpcache.so             only when make found nvcc (the Makefile decides)
    expcache_bench/libexpcache_replay.so  always (the benchmark suite's C replay loop)

``pip install -e .`` runs plain ``make lib`` in the source tree instead: the
editable packages find ``build/`` (pyexpcache/_loader.py, expcache_bench/replay.py).

Knobs, from the environment, handed to make: ``NVCC=`` (empty: host library
only; or a path to nvcc), ``CUDA_ARCHS="80 90"``; CC, CXX and CXXFLAGS reach
make through the environment as usual.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1 (pyproject asks 77)
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
# Each library make builds -> the package folder it is installed into.
LIBS = {
    "libexpcache_host.so": "pyexpcache",
    "libexpcache.so": "pyexpcache",
    "libexpcache_replay.so": "expcache_bench",
}
KNOBS = ("NVCC", "CUDA_ARCHS")  # passed to make on its command line when set
STAMP_KEYS = ("CC", "CXX", "CXXFLAGS")  # with the knobs: a change means a fresh make folder


class build_make(Command):
    """Run ``make lib`` and put its shared libraries into the package."""

    description = "build libexpcache with the Makefile and copy it into the package"
    user_options = []
    editable_mode = False  # set to True by setuptools for `pip install -e .`

    def initialize_options(self):
        self.build_lib = self.build_temp = None
        self._outputs = {}  # installed path -> built path

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"), ("build_temp", "build_temp"))

    def _make(self, build_dir):
        if not (ROOT / "Makefile").exists() or shutil.which("make") is None:
            raise RuntimeError(
                "expcache builds its libraries with make, g++ and cc from a source checkout "
                f"(Makefile, libexpcache/); {ROOT} lacks the Makefile or make is not installed"
            )
        cmd = ["make", "-C", str(ROOT), "lib", f"BUILD={build_dir}", f"PYTHON={sys.executable}"]
        cmd += [f"{k}={os.environ[k]}" for k in KNOBS if k in os.environ]
        if "-j" not in os.environ.get("MAKEFLAGS", ""):
            cmd.append(f"-j{os.cpu_count() or 1}")
        print("expcache: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)

    def run(self):
        if self.editable_mode:
            # The editable package loads from the source tree's build/ (_loader.py).
            self._make("build")
            built = [n for n in LIBS if (ROOT / "build" / n).exists()]
            self._report(built, ROOT / "build")
            return
        # make's own folder inside setuptools' build tree (build-pip/temp.*/make), never
        # build/. Objects are reused between builds, as with make; if a knob changed
        # (the Makefile does not track flags) the folder starts afresh.
        make_dir = Path(self.build_temp).resolve() / "make"
        settings = {k: os.environ.get(k) for k in KNOBS + STAMP_KEYS}
        settings["nvcc_found"] = shutil.which("nvcc")  # the Makefile's default NVCC
        stamp = json.dumps(settings, sort_keys=True)
        stamp_file = make_dir / "setup-py-stamp.json"
        if make_dir.exists() and (not stamp_file.exists() or stamp_file.read_text() != stamp):
            shutil.rmtree(make_dir)
        make_dir.mkdir(parents=True, exist_ok=True)
        stamp_file.write_text(stamp)
        # Remove the libraries first so that what exists afterwards is what make built now.
        for name in LIBS:
            (make_dir / name).unlink(missing_ok=True)
        self._make(make_dir)
        built = []
        for name, package in LIBS.items():
            package_dir = Path(self.build_lib) / package
            package_dir.mkdir(parents=True, exist_ok=True)
            (package_dir / name).unlink(missing_ok=True)  # none left from an earlier build
            if (make_dir / name).exists():
                shutil.copy2(make_dir / name, package_dir / name)
                self._outputs[str(package_dir / name)] = str(make_dir / name)
                built.append(f"{package}/{name}")
        self._report(built, Path(self.build_lib))

    @staticmethod
    def _report(built, where):
        names = [Path(b).name for b in built]
        if "libexpcache_host.so" not in names or "libexpcache_replay.so" not in names:
            raise RuntimeError(f"make lib did not build the host and replay libraries (got {built})")
        cuda = (
            "with the CUDA library"
            if "libexpcache.so" in names
            else "host backend only, no nvcc; NVCC=/path/to/nvcc builds the CUDA library"
        )
        print(f"expcache: libraries in {where}: {', '.join(built)} ({cuda})", flush=True)

    # The sub-command protocol of setuptools' build (used by editable and --record installs).
    def get_outputs(self):
        return list(self._outputs)

    def get_output_mapping(self):
        return dict(self._outputs)

    def get_source_files(self):
        return []


class build_with_make(build):
    sub_commands = build.sub_commands + [("build_make", None)]


class BinaryDistribution(Distribution):
    """The wheel holds native libraries: a platform wheel, installed to platlib."""

    def has_ext_modules(self):
        return True


class bdist_wheel_py3(bdist_wheel):
    """Tag py3-none-<platform>: the libraries are loaded through ctypes, so they
    do not depend on the Python version or ABI, only on the platform."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


cmdclass = {"build": build_with_make, "build_make": build_make, "bdist_wheel": bdist_wheel_py3}

setup(
    distclass=BinaryDistribution,
    cmdclass=cmdclass,
    # setuptools' default build base is build/, where make keeps build/obj and
    # build/*.so for `make` users and editable installs: pip gets its own folder.
    options={"build": {"build_base": "build-pip"}},
)
