#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""Starts ipykernel for the code interpreter's Python contexts, without its debugger:
E2B's API has no use for it, and importing debugpy is a third of a kernel's start.
Everything else is ipykernel's own `ipykernel_launcher`; the server passes the options
(plain tracebacks, no history database, python_startup.py).
"""

import sys

sys.modules["debugpy"] = None  # makes `import debugpy` fail: ipykernel runs without it

from ipykernel import kernelapp  # noqa: E402

if __name__ == "__main__":
    kernelapp.launch_new_instance()
