"""Former home of MindSpore's arithmetic and release profiles, kept so existing imports work.

The rules live in the MindSpore engine: ``ms_shm.engines.mindspore.arithmetic`` (shared memory and fds) and
``ms_shm.engines.mindspore.profiles`` (how releases differ).
"""

from ms_shm.engines.mindspore.arithmetic import *  # noqa: F401,F403
from ms_shm.engines.mindspore.arithmetic import __all__ as _arithmetic
from ms_shm.engines.mindspore.profiles import *  # noqa: F401,F403
from ms_shm.engines.mindspore.profiles import __all__ as _profiles

__all__ = list(_arithmetic) + list(_profiles)
