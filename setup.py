"""Builds the C++ kernels (plugins/csrc) into angelspec.plugins at install time, with torch's
BuildExtension (ninja, in parallel). Everything else about the package is in pyproject.toml.
Install with `pip install --no-build-isolation -e .` once torch is installed (`make setup`).
ANGELSPEC_KERNELS=reuse installs the package around kernels an earlier install built (the export
environment, `make export-env`: same torch, other packages) and leaves them untouched."""
import importlib.util
import os
import pathlib
import shutil
import tempfile

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = pathlib.Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("kernels_build", ROOT / "plugins" / "build.py")
kb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kb)
FULL_NAME = f"angelspec.plugins.{kb.NAME}"


class BuildKernels(BuildExtension):
    """A fresh build folder every time (an interrupted build leaves no half-written objects to
    reuse); the stamp is removed first and written only once the library is in place."""

    def run(self):
        stamps = {pathlib.Path(self.get_ext_fullpath(FULL_NAME)).with_name(kb.STAMP.name), kb.STAMP}
        for stamp in stamps:
            stamp.unlink(missing_ok=True)
        self.build_temp = tempfile.mkdtemp(prefix="angelspec-kernels-")
        try:
            super().run()
        finally:
            shutil.rmtree(self.build_temp, ignore_errors=True)
        pathlib.Path(self.get_ext_fullpath(FULL_NAME)).with_name(kb.STAMP.name).write_text(
            kb.sources_hash() + "\n")


if os.environ.get("ANGELSPEC_KERNELS") == "reuse":
    setup()
else:
    setup(
        ext_modules=[CppExtension(FULL_NAME, [str(p.relative_to(ROOT)) for p in kb.sources()],
                                  extra_compile_args=kb.CFLAGS, extra_link_args=kb.LDFLAGS)],
        cmdclass={"build_ext": BuildKernels},
    )
