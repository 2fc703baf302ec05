"""Only here because cffi's `cffi_modules` needs setuptools; metadata lives in pyproject.toml."""
from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
