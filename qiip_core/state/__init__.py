"""The whole state of a QIIP fleet, backed up, restored, and moved between the backends.

```
take_backup(settings)                          one moment's state of the configured backend, as a backup file
restore(settings, data, replace=, dry_run=)    a backup file's state into the configured backend: all or nothing
migrate(settings, to=, replace=, dry_run=)     the state directory into etcd (a second gateway's path), or back
decode_backup(data) / encode_backup(snapshot)  the file: versioned, self-describing, checksummed (`_file`)
KINDS                                          what a backup holds and where each kind lives (`_kinds`)
```

`qiip state backup|restore|migrate` and `/admin/state/backup|restore` call these. The embedded backend is read and
replaced under the state directory's lock (`qiip_core.storage.StateLock`), etcd at one revision and in one
transaction (`_etcd`), so a kill -9 at any step leaves the old state or the new one, never a mix.
"""

from __future__ import annotations

from qiip_core.state._file import (
    FORMAT,
    FORMAT_VERSION,
    MAX_BACKUP_BYTES,
    Backup,
    Snapshot,
    decode_backup,
    encode_backup,
)
from qiip_core.state._kinds import KINDS, Kind, kind_named
from qiip_core.state._restore import KindChanges, RestoreReport, migrate, restore, take_backup

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KINDS",
    "MAX_BACKUP_BYTES",
    "Backup",
    "Kind",
    "KindChanges",
    "RestoreReport",
    "Snapshot",
    "decode_backup",
    "encode_backup",
    "kind_named",
    "migrate",
    "restore",
    "take_backup",
]
