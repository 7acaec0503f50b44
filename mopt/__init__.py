"""mopt: make for model optimization."""

__version__ = "0.1.0"

import time as _time

#: when this process imported mopt: a module file changed after it was loaded makes the
#: no-op stamp skip (the stamp would record the new file, the build ran the old one)
STARTED_NS = _time.time_ns()
