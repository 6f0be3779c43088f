"""torch_tpu's version: the one place it is written.

Everything else derives it from this file: `torch_tpu.__version__`, the wheel's name and metadata (the Bazel
repository rule in tools/python_configure.bzl reads this file), tools/setup.sh, tools/release and the tests.
A release bumps this line and adds its section to docs/changelog.md.
"""

__version__ = "0.2.0"
