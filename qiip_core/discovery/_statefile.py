"""The registrations file: a `LockedJsonFile` of nodes under the state directory.

The locking, validation and atomic rewrite are `qiip_core.storage`'s, shared with the token file.
"""

from __future__ import annotations

import logging

from qiip_core._errors import RegistryUnavailable
from qiip_core.nodes import Node
from qiip_core.storage import LockedJsonFile

__all__ = ["STATE_FILE_NAME", "StateFile"]

logger = logging.getLogger("qiip.discovery")

STATE_FILE_NAME = "nodes.json"


class StateFile(LockedJsonFile[Node]):
    """The registrations file under a state directory: `{"version": 1, "nodes": [<node>, …]}`.

    Raises `RegistryUnavailable` when it cannot be used. Of two entries with one id, the later one is used.

    Args:
        state_dir: the directory (`QIIP_STATE_DIR`); created on first write.
    """

    file_name = STATE_FILE_NAME
    items_key = "nodes"
    model = Node
    exclude_none = True
    noun = "state file"
    fresh_start = "start with an empty registry"
    error = RegistryUnavailable
    log = logger
