"""Former home of the runtime guard, kept so existing imports work: it is ``ms_shm.engines.mindspore.guard``
(it mirrors MindSpore's own slot allocation)."""

from ms_shm.engines.mindspore.guard import *  # noqa: F401,F403
from ms_shm.engines.mindspore.guard import __all__, _free_bytes  # noqa: F401
