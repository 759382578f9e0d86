"""Former home of the MindSpore adapter, kept so existing imports work: it is
``ms_shm.engines.mindspore.compat``, the only module that imports MindSpore."""

from ms_shm.engines.mindspore.compat import *  # noqa: F401,F403
from ms_shm.engines.mindspore.compat import __all__  # noqa: F401
