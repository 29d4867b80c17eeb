"""The build interpreter's identity for packaging/build.sh's cache keys, once it is known to fit:
CPython 3.11 (the lock pins cp311 wheels) with a shared libpython (PyInstaller bundles it)."""

import sys
import sysconfig

if sys.version_info[:2] != (3, 11):
    raise SystemExit("CPython 3.11 needed (the lock is for cp311)")
if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
    raise SystemExit("CPython without a shared libpython")
print(sys.version.split()[0], sys.implementation.cache_tag)
