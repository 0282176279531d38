# The C core is built by cffi at install time; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["cffi_build/build_native.py:ffibuilder"])
