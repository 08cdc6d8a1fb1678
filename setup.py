"""The C part of the package (everything else is in pyproject.toml): the replay's line splitter."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("fleetwise.schemas._trace_text", ["fleetwise/schemas/_trace_text.c"],
                  extra_compile_args=["-std=c11", "-Wextra"]),
    ],
)
