"""The one-run empirical privacy audit.

Canaries and the report (``core``), the Steinke bound and the f-DP test (``bounds``), canary
scores and the audit's power (``power``).
"""

from dpkfc_med.privacy.audit.core import *  # noqa: F403
from dpkfc_med.privacy.audit.core import __all__  # noqa: F401
