import os
import sys

# Test helpers (dist_utils) import by plain name in the test process and in the
# spawned rank processes, which inherit this sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")
