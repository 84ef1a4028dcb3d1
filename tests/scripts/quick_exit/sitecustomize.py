"""Run first by every Python process the test suite starts (``tests/conftest.py`` puts this folder last on
``PYTHONPATH``): at exit, after every other ``atexit`` hook, the objects alive are frozen, so that the
interpreter's last garbage collections skip them.

A process that imported torch and trained spends about a second of CPU at exit walking torch's objects for
cycles to collect; the suite starts some five hundred such processes. What the library does at exit (its
``atexit`` hooks and ``weakref.finalize`` callbacks) runs before this one, and objects that are not in
reference cycles are still finalized as the interpreter tears its modules down.
"""

import atexit
import gc

atexit.register(gc.freeze)  # registered first, so run last
