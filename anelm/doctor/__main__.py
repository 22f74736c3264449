"""The child process of `anelm doctor` (`isolate.run_isolated`): a JSON request on stdin, events on stdout."""

import sys

from .isolate import child_main

if sys.stdin.isatty():
    print("anelm: error: `python -m anelm.doctor` is the doctor's child process; run `anelm doctor`", file=sys.stderr)
    sys.exit(2)
sys.exit(child_main())
