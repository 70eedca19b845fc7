"""The `:` command line's language: parsing, checking against the fleet, and Tab completion.

```
:drain NODE   :undrain NODE   :remove NODE   :relaunch NODE   :node NODE   :describe NODE   :model MODEL
:fleet   :chat   :logs   :models   :deployments   :help   :quit (:q)
```

Everything here is plain functions over the node ids and model names the fleet holds, so the rules are tested
without a terminal; the command line itself (`qiip_tui.screens.CommandLine`) hands a checked command to the app's
own actions, which still ask before anything destructive.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from os.path import commonprefix
from typing import Literal

__all__ = ["COMMANDS", "Command", "CommandError", "Completion", "complete", "parse"]

ArgumentKind = Literal["node", "model"]

COMMANDS: dict[str, tuple[ArgumentKind | None, str]] = {
    "drain": ("node", "drain a node (asks first)"),
    "undrain": ("node", "take a node back into rotation"),
    "remove": ("node", "remove a node (asks first)"),
    "relaunch": ("node", "open a node's sizing editor"),
    "node": ("node", "open a node's screen"),
    "describe": ("node", "everything about a node, as text"),
    "model": ("model", "the fleet, filtered to a model's nodes"),
    "fleet": (None, "the fleet"),
    "chat": (None, "chat"),
    "logs": (None, "logs: the fleet's timeline, engine logs, provisioning"),
    "models": (None, "the model catalog and downloads"),
    "deployments": (None, "deployments: replicas, events, autoscaling"),
    "help": (None, "the key map of this screen"),
    "quit": (None, "quit the console"),
}
"""Every command, by name: the kind of argument it takes (None: none) and what it does."""

_ALIASES = {"q": "quit"}

_LISTED = 5
"""Names listed in a message before `and N more`."""


class CommandError(ValueError):
    """A command line that cannot run; `str()` is one line naming the thing at fault and the reason."""


@dataclass(frozen=True)
class Command:
    """A checked command: its name (a key of `COMMANDS`) and its argument (a node id or model, or None)."""

    name: str
    argument: str | None = None


@dataclass(frozen=True)
class Completion:
    """What Tab makes of a command line."""

    text: str
    """The completed line (unchanged when nothing completes)."""
    candidates: tuple[str, ...]
    """Every name that fits what was typed (several when Tab could not choose)."""


def _listing(names: Sequence[str], what: str) -> str:
    more = len(names) - _LISTED
    shown = ", ".join(names[:_LISTED]) + (f" and {more} more" if more > 0 else "")
    return f"{len(names)} {what}{'s' if len(names) != 1 else ''}: {shown}"


def _unknown(thing: str, value: str, names: Sequence[str], *, what: str) -> CommandError:
    if not names:
        return CommandError(f"No {thing} {value}; the fleet has no {what}s.")
    return CommandError(f"No {thing} {value}{_did_you_mean(value, names)}; {_listing(names, what)}.")


def _did_you_mean(value: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def parse(text: str, *, nodes: Sequence[str], models: Sequence[str]) -> Command:
    """Read a command line (with or without its leading `:`) and check it against the fleet.

    Args:
        text: what the operator typed, e.g. `drain gpu-9`.
        nodes: the node ids of the fleet, sorted.
        models: the models the fleet's nodes serve, sorted.

    Returns:
        The command, its name and argument checked.

    Raises:
        CommandError: an empty line, an unknown command, a missing or extra argument, or a node or model the
            fleet does not have; the message names it and lists what there is.
    """
    words = text.strip().removeprefix(":").split()
    if not words:
        raise CommandError(f"Type a command, e.g. drain NODE; the commands are {', '.join(COMMANDS)}.")
    name = _ALIASES.get(words[0], words[0])
    if name not in COMMANDS:
        hint = _did_you_mean(name, list(COMMANDS))
        raise CommandError(f"No command named {words[0]}{hint}; the commands are {', '.join(COMMANDS)}.")
    kind, _ = COMMANDS[name]
    arguments = words[1:]
    if kind is None:
        if arguments:
            raise CommandError(f"{name} takes no argument; got {' '.join(arguments)}.")
        return Command(name)
    names = nodes if kind == "node" else models
    if len(arguments) != 1:
        got = f"got {' '.join(arguments)}" if arguments else "got none"
        known = _listing(names, kind) if names else f"the fleet has no {kind}s"
        raise CommandError(f"{name} takes one {kind}: {name} {kind.upper()} ({got}; {known}).")
    argument = arguments[0]
    if argument not in names:
        raise _unknown("node named" if kind == "node" else "node serves a model named", argument, names, what=kind)
    return Command(name, argument)


def complete(text: str, *, nodes: Sequence[str], models: Sequence[str]) -> Completion:
    """Complete the word being typed: a command name first, then the node id or model it takes.

    A single fit completes (a command that takes an argument gets its space); several complete to what they
    share and are listed.

    Args:
        text: the command line so far.
        nodes: the node ids of the fleet, sorted.
        models: the models the fleet's nodes serve, sorted.
    """
    if " " not in text.lstrip():
        typed = text.strip()
        fits = tuple(name for name in COMMANDS if name.startswith(typed))
        if len(fits) == 1:
            return Completion(fits[0] + (" " if COMMANDS[fits[0]][0] else ""), fits)
        return Completion(commonprefix(list(fits)) or text, fits)
    head, _, typed = text.lstrip().partition(" ")
    command = COMMANDS.get(_ALIASES.get(head, head))
    if command is None or command[0] is None or " " in typed.strip():
        return Completion(text, ())
    typed = typed.strip()
    names = nodes if command[0] == "node" else models
    fits = tuple(name for name in names if name.casefold().startswith(typed.casefold()))
    if len(fits) == 1:
        return Completion(f"{head} {fits[0]}", fits)
    return Completion(f"{head} {commonprefix(list(fits)) or typed}", fits)
