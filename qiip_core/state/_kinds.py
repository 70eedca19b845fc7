"""The kinds of state a backup holds, and where each lives in either backend.

```
kind                   embedded (<state_dir>/…)   etcd key                                value
nodes                  nodes.json                 <etcd.prefix><id>                       the node without its id
hosts                  hosts.json                 <etcd.deployments_prefix>hosts/<name>   the host
deployments            deployments.json           <etcd.deployments_prefix>spec/<name>    the deployment
deployment_statuses    deployment-status.json     <etcd.deployments_prefix>status/<name>  its status
tokens                 tokens.json                <etcd.tokens_prefix><id>                the token without its id
provisioning           provisioning.json          <etcd.provisioning_prefix><host>        the task record
```

The same models validate an entry in both backends and in a backup, so a backup of one backend restores into the
other. What is not here on purpose: the fleet's live readings (`/telemetry/`, leased), host leases and the
controller's leader lease (they belong to running processes), the fleet last read from etcd (a cache), and
anything secret (`[admin]` and etcd passwords, attached servers' and hub token files, `qiip up`'s credentials).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from qiip_core.auth import InvokeToken, TokenFile
from qiip_core.deployments import Deployment, DeploymentStatus, EmbeddedDeploymentStore, HostSpec
from qiip_core.discovery import StateFile
from qiip_core.nodes import Node
from qiip_core.provisioning import EmbeddedTaskStore, ProvisioningTask

if TYPE_CHECKING:
    from qiip_core.config import EtcdSettings, Settings
    from qiip_core.storage import LockedJsonFile

__all__ = ["KINDS", "Kind", "kind_named"]


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of state: its model, its document in the state directory and its keys in etcd.

    Attributes:
        name: the kind's name in a backup and in messages (`nodes`).
        noun: one entry, in words (`node`).
        model: the pydantic model an entry validates as.
        exclude_none: whether the entries are written without their None fields (as the document is).
        id_in_key: whether the etcd value leaves the id out (it is the key's last part).
        document: the kind's `LockedJsonFile` under a state directory.
        etcd_prefix: the kind's key prefix in etcd.
    """

    name: str
    noun: str
    model: type[BaseModel]
    exclude_none: bool
    id_in_key: bool
    document: Callable[[Settings], LockedJsonFile[Any]]
    etcd_prefix: Callable[[EtcdSettings], bytes]

    def canonical(self, item: BaseModel) -> dict[str, Any]:
        """The entry as a backup holds it: JSON-ready, id included."""
        return item.model_dump(mode="json", exclude_none=self.exclude_none)

    def validate(self, entry: Any) -> BaseModel:
        """The entry as its model.

        Raises:
            pydantic.ValidationError: it is not a valid entry of this kind.
        """
        return self.model.model_validate(entry)

    def etcd_value(self, entry: dict[str, Any]) -> bytes:
        """The etcd value of a canonical entry (compact JSON, as the kind's store writes it)."""
        value = {k: v for k, v in entry.items() if k != "id"} if self.id_in_key else entry
        return json.dumps(value, separators=(",", ":")).encode()

    def from_etcd(self, key_id: str, value: dict[str, Any]) -> dict[str, Any]:
        """The entry an etcd value holds (its id from the key where the value leaves it out)."""
        return {**value, "id": key_id} if self.id_in_key else value


def _deployments_prefix(part: str) -> Callable[[EtcdSettings], bytes]:
    return lambda etcd: etcd.deployments_prefix.encode() + part.encode()


KINDS: tuple[Kind, ...] = (
    Kind(
        "nodes", "node", Node, True, True, lambda s: StateFile(s.state_dir), lambda etcd: etcd.prefix.encode()
    ),
    Kind(
        "hosts", "host", HostSpec, False, False, lambda s: EmbeddedDeploymentStore(s).host_file,
        _deployments_prefix("hosts/"),
    ),
    Kind(
        "deployments", "deployment", Deployment, False, False, lambda s: EmbeddedDeploymentStore(s).spec_file,
        _deployments_prefix("spec/"),
    ),
    Kind(
        "deployment_statuses", "deployment status", DeploymentStatus, False, False,
        lambda s: EmbeddedDeploymentStore(s).status_file, _deployments_prefix("status/"),
    ),
    Kind(
        "tokens", "token", InvokeToken, False, True, lambda s: TokenFile(s.state_dir),
        lambda etcd: etcd.tokens_prefix.encode(),
    ),
    Kind(
        "provisioning", "provisioning record", ProvisioningTask, False, False,
        lambda s: EmbeddedTaskStore(s, "").file, lambda etcd: etcd.provisioning_prefix.encode(),
    ),
)  # fmt: skip
"""Every kind, in the order a backup lists and a restore reports them."""


def kind_named(name: str) -> Kind | None:
    """The kind called `name`, or None."""
    return next((kind for kind in KINDS if kind.name == name), None)
