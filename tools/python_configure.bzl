"""Repository rule: probes the chosen Python for torch, its C++ ABI flag, the Python headers and pybind11.

The Python is $TORCH_TPU_PYTHON, else <workspace>/.venv/bin/python, else python3 on PATH. It writes the
repository @local_torch with
  //:torch_python_extension  cc_library to build a torch Python extension against
  //:defs.bzl                PY_TAG, TORCH_VERSION, TORCH_MINOR, PYTHON, and VERSION (torch_tpu's own, read
                             from torch_tpu/_version.py, the one place it is written) for BUILD files
"""

_REQUIRED_TORCH_MINOR = "2.13"

_PROBE = r'''
import json, os, sys, sysconfig
try:
    import torch
except Exception as e:
    print(json.dumps({"error": "cannot import torch: %s" % e})); sys.exit(0)
tdir = os.path.dirname(torch.__file__)
print(json.dumps({
    "python": sys.executable,
    "py_tag": "cp%d%d" % sys.version_info[:2],
    "py_include": sysconfig.get_paths()["include"],
    "torch_version": torch.__version__,
    "torch_include": os.path.join(tdir, "include"),
    "torch_lib": os.path.join(tdir, "lib"),
    "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
}))
'''

def _torch_tpu_version(rctx):
    # Reading the file through its label makes Bazel rerun this rule when the version changes.
    text = rctx.read(rctx.path(Label("//torch_tpu:_version.py")))
    for line in text.splitlines():
        if line.startswith("__version__ = "):
            return line[len("__version__ = "):].strip().strip("\"'")
    fail("torch_tpu: torch_tpu/_version.py has no `__version__ = \"X.Y.Z\"` line (the one place the version is written).")

def _python_configure_impl(rctx):
    ws = rctx.path(Label("//:WORKSPACE")).dirname
    python = rctx.os.environ.get("TORCH_TPU_PYTHON", "")
    if not python:
        venv = ws.get_child(".venv").get_child("bin").get_child("python")
        python = str(venv) if venv.exists else "python3"
    res = rctx.execute([python, "-c", _PROBE], timeout = 120)
    if res.return_code != 0:
        fail("torch_tpu: could not run the Python '%s' to probe torch: %s%s\nRun tools/setup.sh, or set TORCH_TPU_PYTHON to a Python with torch==%s.*" % (python, res.stdout, res.stderr, _REQUIRED_TORCH_MINOR))
    info = json.decode(res.stdout.strip().splitlines()[-1])
    if "error" in info:
        fail("torch_tpu: %s (Python: %s). Install it: pip install torch==%s.0 (or run tools/setup.sh)." % (info["error"], python, _REQUIRED_TORCH_MINOR))
    version = info["torch_version"].split("+")[0]
    minor = ".".join(version.split(".")[:2])
    if minor != _REQUIRED_TORCH_MINOR:
        fail("torch_tpu: the Python %s has torch %s, but torch_tpu builds against torch %s.*. Install it: pip install torch==%s.0 (or run tools/setup.sh)." % (python, info["torch_version"], _REQUIRED_TORCH_MINOR, _REQUIRED_TORCH_MINOR))
    pybind = rctx.path(info["torch_include"] + "/pybind11")
    if not pybind.exists:
        fail("torch_tpu: torch's bundled pybind11 headers are missing under %s" % info["torch_include"])

    rctx.symlink(info["torch_include"], "torch_include")
    rctx.symlink(info["torch_lib"], "torch_lib")
    rctx.symlink(info["py_include"], "python_include")
    rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "torch_python_extension",
    hdrs = glob(["torch_include/**/*.h", "torch_include/**/*.hpp", "torch_include/**/*.cuh", "python_include/**/*.h"]),
    includes = ["torch_include", "torch_include/torch/csrc/api/include", "python_include"],
    defines = ["_GLIBCXX_USE_CXX11_ABI={abi}", "TORCH_EXTENSION_NAME=_C", "TORCH_API_INCLUDE_EXTENSION_H"],
    linkopts = ["-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10"],
)
""".format(abi = info["cxx11_abi"], lib = info["torch_lib"]))
    rctx.file("defs.bzl", """
PYTHON = "{python}"
PY_TAG = "{py_tag}"
TORCH_VERSION = "{version}"
TORCH_MINOR = "{minor}"
VERSION = "{torch_tpu_version}"
""".format(python = python, py_tag = info["py_tag"], version = version, minor = minor, torch_tpu_version = _torch_tpu_version(rctx)))

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["TORCH_TPU_PYTHON"],
    local = True,
)
